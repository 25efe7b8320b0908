"""The OpenAI-compatible server, driven by the official `openai` client (and raw httpx where the wire format itself is
under test) against servers started here on loopback, over a tiny random llama in fp32: completions and chats equal
the engine's generate(), streams and their wire format, per-request sampling inside one batch, OpenAI-style errors,
the API key, the queue limit and the KV budget, and disconnected or cancelled requests giving back their rows and
blocks.

Continuous batching, the prefix cache and preemption are tested in test_serve_scheduling.py, quantized KV and
speculative decoding in test_serve_spec_kv.py, hostile input in test_serve_hardening.py. Those files import the
prompts and helpers defined here (the server starter, the engine's text, a stream's text, /metrics and /health
readers, the scheduler driver); the served model, `loaded`, is a fixture in tests/conftest.py."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from toolkit.engine.generate import generate
from toolkit.engine.sampling import SamplingParams
from toolkit.serve.server import BackgroundServer, ServeSettings, build_state

MODEL = "tiny"
PROMPTS = ["The class statement", "def f(x): return", "Exceptions are raised when a program meets an error and the "
           "interpreter stops", "import os", "A function definition is an executable statement. Its execution binds "
           "the function name in the current local namespace to a function object", "while True:", "The with "
           "statement is used to wrap the execution of a block", "yield", "Lambda expressions are used to create "
           "anonymous functions", "for x in range(10): print(x)"]
MAX_TOKENS = [24, 9, 31, 17, 12, 40, 5, 28, 20, 15]  # different lengths: rows leave the batch at different steps

# a long system prompt that requests share (the prefix cache, preemption over it)
SYSTEM = ("You answer questions about Python. " + PROMPTS[4] + ". " + PROMPTS[2] + ". " + PROMPTS[8] + ".")
QUESTIONS = ["What does yield do?", "How do I open a file?", "What is a lambda?", "Explain while loops.",
             "What is a class?"]


def _start(loaded, **settings):
    return BackgroundServer(build_state(loaded, ServeSettings(model_id=MODEL, **settings)))


@pytest.fixture(scope="module")
def server(loaded):
    # max_batch below the number of concurrent clients: some wait in the queue and join as rows free up
    with _start(loaded, max_batch=6, max_queue=32, max_tokens=500, max_seq_len=512) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _engine_text(loaded, prompt, max_tokens, stop=()):
    return generate(loaded.model, loaded.tokenizer, [prompt], max_tokens, stop_strings=stop).sequences[0].text


def _stream_text(client, prompt, max_tokens, **kw) -> str:
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, **kw)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
              or line.startswith(name + "{")]
    return sum(values)


def _wait_idle(server, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(server.url + "/health").json()
        if health["running"] == 0 and health["waiting"] == 0:
            # the metrics are published at the end of the scheduler's turn, just after /health can read idle
            while _metric(server, "specquant_kv_blocks_used") and time.monotonic() < deadline:
                time.sleep(0.02)
            return health
        time.sleep(0.05)
    raise AssertionError(f"server still busy after {timeout} s: {health}")


def _assert_pool_empty(scheduler) -> None:
    """No live sequence holds a block: every reference count is back to zero (blocks are free or cached)."""
    pool = scheduler.cache.pool
    assert pool.used == 0 and all(count == 0 for count in pool.ref_count)
    assert pool.available == pool.num_blocks
    pool.check()


def _run_scheduler(model, tokenizer, limits, prompts, spec=None):
    """Submit every (prompt, max_tokens) at once to a Scheduler (no HTTP); return it (stopped) and, per request, its
    final event and the text its token events streamed."""
    from toolkit.engine.generate import stop_token_ids
    from toolkit.serve.metrics import ServerMetrics
    from toolkit.serve.scheduler import Scheduler
    from toolkit.serve.sequence import Sequence

    scheduler = Scheduler(model, tokenizer, stop_token_ids(model, tokenizer), limits, ServerMetrics(), spec)
    done, streamed, finished = {}, {i: "" for i in range(len(prompts))}, threading.Event()

    def emitter(i):
        def emit(event):
            if event["type"] == "token":
                streamed[i] += event["text"]
            if event["type"] in ("done", "error"):
                done[i] = event
                if len(done) == len(prompts):
                    finished.set()
        return emit

    scheduler.start()
    try:
        for i, (prompt, n) in enumerate(prompts):
            scheduler.submit(Sequence(tokenizer(prompt).input_ids, n, SamplingParams(), [], emitter(i)))
        assert finished.wait(120)
    finally:
        scheduler.stop()
    return scheduler, [done[i] for i in range(len(prompts))], [streamed[i] for i in range(len(prompts))]


def test_completion_equals_engine_generate(client, loaded):
    result = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=20, temperature=0)
    choice = result.choices[0]
    assert choice.text == _engine_text(loaded, PROMPTS[2], 20)
    assert choice.finish_reason == "length"
    prompt_tokens = len(loaded.tokenizer(PROMPTS[2]).input_ids)
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (prompt_tokens, 20)
    assert result.usage.total_tokens == prompt_tokens + 20
    timings = result.model_extra["timings"]
    assert timings["ttft_ms"] > 0 and timings["itl_mean_ms"] > 0 and timings["acceptance_rate"] is None


def test_completion_from_token_ids_and_stop_string(client, loaded):
    ids = loaded.tokenizer(PROMPTS[0]).input_ids
    full = _engine_text(loaded, PROMPTS[0], 30)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=30, temperature=0).choices[0].text == full
    stop = full[5:8]  # a piece of what greedy decoding will produce: the text must end right before it
    result = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=30, temperature=0, stop=[stop])
    assert result.choices[0].finish_reason == "stop"
    assert result.choices[0].text == full[:full.index(stop)]


def test_chat_uses_the_chat_template(client, loaded):
    messages = [{"role": "user", "content": "What does the class statement do?"}]
    result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    text = loaded.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = loaded.tokenizer(text, add_special_tokens=False).input_ids
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == _engine_text(loaded, ids, 16)
    assert result.usage.prompt_tokens == len(ids)


def test_chat_streaming_with_usage_chunk(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a loop."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_stream_wire_format_ends_with_done(server):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: "):])
    assert last["object"] == "text_completion" and last["choices"][0]["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 6 and "ttft_ms" in last["timings"]


def test_concurrent_streams_equal_sequential_and_engine(client, server, loaded):
    sequential = [_stream_text(client, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    server.state.scheduler.peak_batch = 0
    start = threading.Barrier(len(PROMPTS))

    def one(args):
        start.wait()
        return _stream_text(client, *args)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        concurrent = list(pool.map(one, zip(PROMPTS, MAX_TOKENS)))
    assert server.state.scheduler.peak_batch > 1, "the requests never shared a decode step"
    assert concurrent == sequential
    assert sequential == [_engine_text(loaded, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    _wait_idle(server)
    assert _metric(server, "specquant_kv_bytes_in_use") == 0


def test_per_request_sampling_in_one_batch(client, server):
    """Seeded sampled requests share a batch with greedy ones and get what they get alone."""
    kinds = [dict(temperature=0.9, top_k=40, seed=7), dict(temperature=0), dict(temperature=1.3, top_p=0.8, seed=3),
             dict(temperature=0)] * 2

    def ask(kw):
        extra = {"top_k": kw["top_k"]} if "top_k" in kw else None
        args = {k: v for k, v in kw.items() if k != "top_k"}
        chunks = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=25, stream=True,
                                           extra_body=extra, **args)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    alone = [ask(kw) for kw in kinds[:4]]
    assert alone[0] != alone[1] != alone[2]  # sampling really sampled
    with ThreadPoolExecutor(len(kinds)) as pool:
        together = list(pool.map(ask, kinds))
    assert together == alone * 2


def test_disconnect_mid_stream_frees_the_slot(server):
    cancelled = _metric(server, 'specquant_sequences_finished_total{reason="cancelled"}')
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                assert httpx.get(server.url + "/health").json()["running"] == 1
                break  # abandoning the line iterator closes the connection: the client is gone
    _wait_idle(server)
    assert _metric(server, 'specquant_sequences_finished_total{reason="cancelled"}') == cancelled + 1
    assert _metric(server, "specquant_kv_bytes_in_use") == 0
    assert _metric(server, "specquant_queue_length") == 0
    assert _metric(server, "specquant_batch_size") == 0
    _assert_pool_empty(server.state.scheduler)


BAD = [  # (body or raw bytes, status, param, code)
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ({"model": MODEL, "prompt": "word " * 600}, 400, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 501}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": [40] * 200, "max_tokens": 400}, 400, "max_tokens", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": "hi", "temperature": -0.5}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 3}, 400, "logprobs", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "frobnicate", "unsupported_parameter"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "invalid_value"),
    ({"model": MODEL}, 400, "prompt", "invalid_type"),
]


@pytest.mark.parametrize("body,status,param,code", BAD, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD)])
def test_bad_completion_input_gets_openai_error(server, body, status, param, code):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(server.url + "/v1/completions", timeout=30, **kw)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)


@pytest.mark.parametrize("body,param,code", [
    ({"model": MODEL, "messages": []}, "messages", "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs",
     "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools",
     "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 600}]}, "messages",
     "context_length_exceeded"),
])
def test_bad_chat_input_gets_openai_error(server, body, param, code):
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (param, code)


def test_openai_client_raises_on_bad_input_and_server_keeps_serving(client, loaded):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=-1)
    assert err.value.body["param"] == "temperature"
    assert client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0).choices[0].text \
        == _engine_text(loaded, PROMPTS[3], 8)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_unknown_route_is_an_openai_404(server):
    response = httpx.get(server.url + "/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_api_key_queue_limit_and_kv_budget(loaded):
    with _start(loaded, api_key="s3cret", max_batch=1, max_queue=1, max_tokens=500, max_seq_len=512,
                max_kv_tokens=505) as srv:
        assert srv.host == "127.0.0.1"
        anonymous = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        headers = {"Authorization": "Bearer s3cret"}
        # beyond the KV budget however long one waits: refused at once, not queued
        too_big = httpx.post(srv.url + "/v1/completions", headers=headers, timeout=30,
                             json={"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 500})
        assert too_big.status_code == 400 and too_big.json()["error"]["code"] == "context_length_exceeded"
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 480, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=headers, timeout=60) as running:
            lines = running.iter_lines()  # kept referenced: an abandoned iterator closes the connection
            next(lines)  # the one row is busy
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, headers=headers, timeout=60) as queued:
                deadline = time.monotonic() + 10
                while len(srv.state.scheduler.waiting) < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                refused = httpx.post(srv.url + "/v1/completions", json=body, headers=headers, timeout=30)
                assert refused.status_code == 429
                assert int(refused.headers["retry-after"]) >= 1
                assert refused.json()["error"]["type"] == "rate_limit_error"
                assert queued.status_code == 200
        _wait_idle(srv)
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0).usage.completion_tokens


def test_blocks_return_to_the_pool_after_a_burst_with_a_cancelled_stream(server, client, loaded):
    scheduler = server.state.scheduler
    cancelled = _metric(server, 'specquant_sequences_finished_total{reason="cancelled"}')
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 480, "temperature": 0, "stream": True}

    def abandon():
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for i, _ in enumerate(response.iter_lines()):
                if i == 4:
                    break  # the client goes away mid-stream

    with ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        gone = pool.submit(abandon)
        texts = list(pool.map(lambda args: _stream_text(client, *args), zip(PROMPTS, MAX_TOKENS)))
        gone.result()
    assert texts == [_engine_text(loaded, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    _wait_idle(server)
    assert _metric(server, 'specquant_sequences_finished_total{reason="cancelled"}') == cancelled + 1
    _assert_pool_empty(scheduler)
    assert _metric(server, "specquant_kv_blocks_used") == 0 and _metric(server, "specquant_kv_tokens") == 0
    assert _metric(server, "specquant_kv_blocks_free") == _metric(server, "specquant_kv_blocks_total") \
        == scheduler.cache.pool.num_blocks
    assert _metric(server, "specquant_kv_bytes_in_use") == 0
