"""An OpenAI-compatible HTTP server over the engine, with continuous batching.

    kv_pool.py     the paged KV block pool every running sequence shares; admission's block arithmetic
    sequence.py    one request's state and events
    scheduler.py   the model loop on its own thread: admission by free blocks, prefill, batched decode,
                   preemption, cancellation
    protocol.py    request bodies checked field by field; OpenAI-style errors
    app.py         the FastAPI routes, JSON and server-sent events
    metrics.py     Prometheus metrics
    server.py      build a server from a loaded model; run it (foreground or background thread)
"""
