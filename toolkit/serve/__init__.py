"""An OpenAI-compatible HTTP server over the engine, with continuous batching.

    slot_cache.py  the per-row KV cache rows of different lengths decode together in
    sequence.py    one request's state and events
    scheduler.py   the model loop on its own thread: admission, prefill, batched decode, cancellation
    protocol.py    request bodies checked field by field; OpenAI-style errors
    app.py         the FastAPI routes, JSON and server-sent events
    metrics.py     Prometheus metrics
    server.py      build a server from a loaded model; run it (foreground or background thread)
"""
