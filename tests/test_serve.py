"""The OpenAI-compatible server, driven by the official `openai` client (and raw httpx where the wire format itself is
under test) against servers started here on loopback, over a tiny random llama in fp32.

The central claim: continuous batching changes nothing about what a request gets. Concurrent requests that join and
leave the running batch at different steps (sequences of different lengths in one paged KV pool) produce exactly the
greedy tokens they get when served one at a time, and exactly what the engine's own generate() gives (so the paged
cache is checked against the engine's contiguous cache, not against itself); so do requests that reuse a cached
prompt prefix, and requests preempted (and recomputed) when a tiny pool runs out. Every block goes back to the pool
when its request ends, cancelled ones included.

Speculative decoding (spec=lookup) is held to the same standard: greedy tokens exactly generate()'s, each row of a
verify pass keeping its own accepted length. Quantized KV (kv=int8) cannot be token-exact against the fp engine: it
is checked to run, stream, survive running out of staging slots and free its pool, and (on SmolLM2) to agree with
full precision on most tokens."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from omegaconf import OmegaConf

from toolkit.engine.generate import generate
from toolkit.engine.sampling import SamplingParams
from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.kv import KVSpec
from toolkit.serve.server import BackgroundServer, ServeSettings, build_state

MODEL = "tiny"
PROMPTS = ["The class statement", "def f(x): return", "Exceptions are raised when a program meets an error and the "
           "interpreter stops", "import os", "A function definition is an executable statement. Its execution binds "
           "the function name in the current local namespace to a function object", "while True:", "The with "
           "statement is used to wrap the execution of a block", "yield", "Lambda expressions are used to create "
           "anonymous functions", "for x in range(10): print(x)"]
MAX_TOKENS = [24, 9, 31, 17, 12, 40, 5, 28, 20, 15]  # different lengths: rows leave the batch at different steps


@pytest.fixture(scope="module")
def loaded(chat_model_dir):
    engine = EngineSpec(dtype="fp32", threads=None, compile=False)
    return load_engine_model(str(chat_model_dir), engine)


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


def test_scheduler_matches_generate_on_both_architectures(tiny_model):
    """Per-row masks over the paged pool, sliding windows (gemma3: window 8 < these prompts) included, no HTTP."""
    from toolkit.serve.scheduler import Limits

    model, tokenizer = tiny_model
    prompts = list(zip(PROMPTS[:6], MAX_TOKENS[:6]))
    scheduler, done, _ = _run_scheduler(model, tokenizer, Limits(4, 16, 4096, 256), prompts)
    assert scheduler.peak_batch > 1 and scheduler.preemptions == 0
    expected = [generate(model, tokenizer, [p], n).sequences[0] for p, n in prompts]
    assert [d["token_ids"] for d in done] == [s.token_ids for s in expected]
    _assert_pool_empty(scheduler)


def test_preemption_in_a_tiny_pool_keeps_greedy_output(tiny_model):
    """A pool of 20 blocks of 4 tokens: each request fits alone, four together do not. The newest is preempted,
    recomputed from prompt + what it generated, and still gets the engine's tokens; its stream sends nothing twice."""
    from toolkit.serve.scheduler import Limits

    model, tokenizer = tiny_model
    prompts = list(zip(PROMPTS[:6], MAX_TOKENS[:6]))
    limits = Limits(max_batch=4, max_queue=16, max_kv_tokens=80, max_seq_len=256, block_size=4)
    scheduler, done, streamed = _run_scheduler(model, tokenizer, limits, prompts)
    assert scheduler.preemptions > 0, "the pool never ran out: the test lost its point"
    expected = [generate(model, tokenizer, [p], n).sequences[0] for p, n in prompts]
    assert [d["token_ids"] for d in done] == [s.token_ids for s in expected]
    assert [d["text"] for d in done] == streamed == [s.text for s in expected]
    assert [d["usage"]["prompt_tokens"] for d in done] == [len(tokenizer(p).input_ids) for p, _ in prompts]
    _assert_pool_empty(scheduler)


def test_overflowed_step_is_redone_exactly(tiny_model, monkeypatch):
    """fp16-weight models redo a step whose logits overflowed, under exact linears. Simulated here: outside
    exact_linears every call writes garbage keys/values and returns NaN logits. The redo reruns the same binding
    (nothing is committed before it), overwriting the garbage, so prefills (prefix reuse included), decode steps and
    preempted sequences all still match generate()."""
    import importlib

    from toolkit.passes import Pass
    from toolkit.serve.scheduler import Limits

    model, tokenizer = tiny_model
    prompts = [(PROMPTS[4] + " " + p, n) for p, n in zip(PROMPTS[:4], MAX_TOKENS[:4])]  # a shared prefix
    expected = [generate(model, tokenizer, [p], n).sequences[0].token_ids for p, n in prompts]
    calls = {"inexact": 0}

    def garbage_in(module, args, output):
        return None if Pass.exact else torch.randn_like(output) * 10

    def nan_out(module, args, output):
        if Pass.exact:
            return None
        calls["inexact"] += 1
        return torch.full_like(output, float("nan"))

    precision = importlib.import_module("toolkit.engine.precision")
    monkeypatch.setattr(precision, "may_overflow", lambda model: True)  # what paged_forward's check (`overflowed`) asks
    hooks = [model.get_input_embeddings().register_forward_hook(garbage_in),
             model.get_output_embeddings().register_forward_hook(nan_out)]
    try:
        limits = Limits(max_batch=4, max_queue=16, max_kv_tokens=120, max_seq_len=256, block_size=4)
        scheduler, done, _ = _run_scheduler(model, tokenizer, limits, prompts)
    finally:
        for hook in hooks:
            hook.remove()
    assert calls["inexact"] > 0 and scheduler.preemptions > 0 and scheduler.cache.pool.stats.prefix_hits > 0
    assert [d["token_ids"] for d in done] == expected
    _assert_pool_empty(scheduler)


SYSTEM = ("You answer questions about Python. " + PROMPTS[4] + ". " + PROMPTS[2] + ". " + PROMPTS[8] + ".")
QUESTIONS = ["What does yield do?", "How do I open a file?", "What is a lambda?", "Explain while loops.",
             "What is a class?"]


def test_prefix_cache_on_and_off_give_identical_output(loaded):
    """Requests sharing a long system prompt: the prefix-caching server prefills the shared blocks once, and every
    answer equals the one from a server without prefix caching and the engine's generate()."""
    conversations = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    answers, servers = {}, {}
    for prefix_cache in (True, False):
        with _start(loaded, max_batch=4, max_tokens=64, max_seq_len=512, block_size=8,
                    prefix_cache=prefix_cache) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)

            def ask(messages):
                result = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
                return result.choices[0].message.content

            first = ask(conversations[0])  # fills the cache with the system prompt's blocks
            with ThreadPoolExecutor(len(conversations)) as pool:  # then all of them share those blocks at once
                answers[prefix_cache] = [first] + list(pool.map(ask, conversations))
            _wait_idle(srv)
            _assert_pool_empty(srv.state.scheduler)
            servers[prefix_cache] = {name: _metric(srv, name) for name in (
                "specquant_prefix_cache_hit_rate", "specquant_prefix_cache_hits_total",
                "specquant_prefix_cache_queries_total", "specquant_prompt_tokens_total")}
    assert answers[True] == answers[False]
    ids = [loaded.tokenizer(loaded.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False).input_ids for m in conversations]
    assert len(ids[0]) > 64  # several shared blocks of 8
    assert answers[True] == [_engine_text(loaded, ids[0], 20)] + [_engine_text(loaded, i, 20) for i in ids]
    cached, plain = servers[True], servers[False]
    assert cached["specquant_prefix_cache_hit_rate"] > 0 and cached["specquant_prefix_cache_hits_total"] > 0
    assert plain["specquant_prefix_cache_queries_total"] == 0 and plain["specquant_prefix_cache_hit_rate"] == 0
    assert cached["specquant_prompt_tokens_total"] < plain["specquant_prompt_tokens_total"]  # less was prefilled


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


def test_preemption_over_http_streams_each_token_once(loaded):
    """Streams through a server whose pool holds two of these requests at most: some are preempted mid-stream, and
    each client still reads exactly the engine's text (nothing re-sent after the recompute)."""
    with _start(loaded, max_batch=4, max_tokens=64, max_seq_len=256, max_kv_tokens=96, block_size=4) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        jobs = [(PROMPTS[i], 40) for i in (0, 2, 5, 8)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            texts = list(pool.map(lambda args: _stream_text(client, *args), jobs))
        _wait_idle(srv)
        assert _metric(srv, "specquant_preemptions_total") > 0
        _assert_pool_empty(srv.state.scheduler)
        # one request needing more blocks than the whole pool is refused up front, with the pool's size
        refused = httpx.post(srv.url + "/v1/completions", timeout=30,
                             json={"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 60})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
        assert "96 tokens" in refused.json()["error"]["message"]
    assert texts == [_engine_text(loaded, p, n) for p, n in jobs]


@pytest.mark.real_model
def test_smollm2_prefix_reuse_and_preemption_match_generate(smollm2):
    """The real model (30 layers, grouped-query attention): requests sharing a system prompt through a pool too small
    for all of them at once reuse its blocks and get preempted, and still decode exactly as generate() does."""
    from toolkit.serve.scheduler import Limits

    model, tokenizer = smollm2.model, smollm2.tokenizer
    prompts = [(f"{SYSTEM}\nQuestion: {q}\nAnswer:", 32) for q in QUESTIONS[:4]]  # 66 tokens: 5 blocks, 3 shared
    shared = len(tokenizer(SYSTEM).input_ids)
    assert shared > 48  # three full blocks of 16 at least
    limits = Limits(max_batch=4, max_queue=8, max_kv_tokens=10 * 16, max_seq_len=512, block_size=16)
    scheduler, done, streamed = _run_scheduler(model, tokenizer, limits, prompts)
    assert scheduler.cache.pool.stats.prefix_hits > 0 and scheduler.preemptions > 0
    expected = [generate(model, tokenizer, [p], n).sequences[0] for p, n in prompts]
    assert [d["token_ids"] for d in done] == [s.token_ids for s in expected]
    assert streamed == [s.text for s in expected]
    _assert_pool_empty(scheduler)


def test_kv_pool_sizing_by_tokens_or_megabytes(loaded):
    from toolkit.errors import InputError
    from toolkit.kv.paged import PagedKVCache

    by_tokens = build_state(loaded, ServeSettings(max_kv_tokens=1000, block_size=16)).scheduler
    assert by_tokens.cache.pool.num_blocks == 63 and by_tokens.kv_capacity_tokens == 1008  # rounded up to blocks
    per_block = PagedKVCache.bytes_per_block(loaded.model, 8)
    by_bytes = build_state(loaded, ServeSettings(kv_budget_mb=1, block_size=8)).scheduler
    assert by_bytes.cache.pool.num_blocks == 2**20 // per_block and by_bytes.cache.storage.nbytes <= 2**20
    assert by_bytes.fits(by_bytes.kv_capacity_tokens) and not by_bytes.fits(by_bytes.kv_capacity_tokens + 1)
    with pytest.raises(InputError, match="kv_budget_mb"):
        build_state(loaded, ServeSettings(kv_budget_mb=per_block / 2**21))


# --- quantized KV and speculative decoding ------------------------------------------------------------------------
# A small residual window and small blocks, so these short requests really seal (quantize) blocks and read them back.
INT8 = KVSpec.from_node({"kind": "int8", "residual": 8})
# Prompts that repeat themselves, so prompt lookup finds n-grams to draft (the tiny random models also loop).
REPEATING = [("one two three four one two three four one two three", 24), ("def f(x): return x\ndef g(x): return",
             17), ("a b a b a b a b a", 31), (PROMPTS[4] + ". " + PROMPTS[4], 12), ("while True: while True:", 40),
             ("import os import os import", 9)]


def _lookup(k=4, max_batch=4):
    from toolkit.serve.speculation import serve_spec

    return serve_spec(OmegaConf.create({"kind": "lookup", "k": k, "ngram_max": 3, "ngram_min": 1}), max_batch)


def test_spec_lookup_matches_generate_on_both_architectures(tiny_model):
    """Several sequences speculate in one batch, each keeping its own accepted length and cropped back to it: the
    greedy tokens are exactly generate()'s, drafts were really accepted, and every block goes back."""
    from toolkit.serve.scheduler import Limits

    model, tokenizer = tiny_model
    scheduler, done, streamed = _run_scheduler(model, tokenizer, Limits(4, 16, 4096, 256, block_size=4), REPEATING,
                                               spec=_lookup(k=4, max_batch=4))
    expected = [generate(model, tokenizer, [p], n).sequences[0] for p, n in REPEATING]
    assert [d["token_ids"] for d in done] == [s.token_ids for s in expected]
    assert streamed == [s.text for s in expected]
    assert scheduler.spec_rounds > 0 and scheduler.peak_batch > 1
    assert scheduler.spec_accepted > 0, "no drafted token was ever accepted: the test lost its point"
    rates = [d["timings"]["acceptance_rate"] for d in done]
    assert any(r is not None and r > 0 for r in rates) and all(r is None or 0 <= r <= 1 for r in rates)
    _assert_pool_empty(scheduler)


def test_spec_only_at_small_batch_and_stops_mid_run(loaded):
    """Above spec_max_batch rows a turn is a plain decode step; a stop string or max_tokens inside an accepted run
    ends the request there (nothing after it is emitted)."""
    from toolkit.serve.scheduler import Limits

    prompts = [(p, n) for p, n in REPEATING[:4]]
    scheduler, done, _ = _run_scheduler(loaded.model, loaded.tokenizer, Limits(4, 16, 4096, 256), prompts,
                                        spec=_lookup(k=6, max_batch=1))
    expected = [generate(loaded.model, loaded.tokenizer, [p], n).sequences[0] for p, n in prompts]
    assert [d["token_ids"] for d in done] == [s.token_ids for s in expected]
    assert [d["usage"]["completion_tokens"] for d in done] == [len(s.token_ids) for s in expected]
    assert scheduler.peak_batch > 1  # batched turns ran, and spec turns only once the batch had shrunk to one
    with _start(loaded, max_tokens=100, max_seq_len=256, spec="lookup") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = REPEATING[0][0]
        full = _engine_text(loaded, prompt, 40)
        stop = full[len(full) // 2:len(full) // 2 + 3]
        assert stop.strip()
        result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
        assert result.choices[0].text == _engine_text(loaded, prompt, 40, stop=[stop])
        _wait_idle(srv)
        _assert_pool_empty(srv.state.scheduler)


def test_spec_lookup_over_http_concurrent_streams(loaded):
    """The server with spec=lookup: concurrent streams get the engine's greedy text, the response timings carry
    each request's acceptance rate and /metrics the server's."""
    with _start(loaded, max_batch=4, max_queue=16, max_tokens=100, max_seq_len=256, spec="lookup",
                spec_max_batch=4) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(REPEATING)) as pool:
            texts = list(pool.map(lambda job: _stream_text(client, *job), REPEATING))
        assert texts == [_engine_text(loaded, p, n) for p, n in REPEATING]
        body = {"model": MODEL, "prompt": REPEATING[2][0], "max_tokens": 31, "temperature": 0}
        timings = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["timings"]
        assert 0 < timings["acceptance_rate"] <= 1
        # sampled rows verify by rejection sampling; a seeded request served alone is reproducible
        sampled = [client.completions.create(model=MODEL, prompt=REPEATING[2][0], max_tokens=30, temperature=0.8,
                                             seed=7) for _ in range(2)]
        assert sampled[0].choices[0].text == sampled[1].choices[0].text
        assert sampled[0].usage.completion_tokens <= 30
        _wait_idle(srv)
        assert 0 < _metric(srv, "specquant_spec_acceptance_rate") <= 1
        _assert_pool_empty(srv.state.scheduler)


def test_spec_kinds_the_server_does_not_run_are_refused(loaded):
    from toolkit.errors import InputError

    for kind in ("self", "draft"):
        with pytest.raises(InputError, match=f"(?s)spec={kind} is not supported by the server.*lookup"):
            build_state(loaded, ServeSettings(spec=kind))
    # a rejected draft is cropped away; it may not reach back into quantized (sealed) blocks
    with pytest.raises(InputError, match="kv.residual"):
        build_state(loaded, ServeSettings(kv=KVSpec.from_node({"kind": "int8", "residual": 2}), spec="lookup"))


def test_int8_kv_server_streams_and_frees_the_pool(loaded):
    """kv=int8: quantized blocks (sealed 8 tokens behind), concurrent streams finish, the pool goes back to zero;
    with spec=lookup too (verify passes and crops over quantized blocks; k=4, within the 8 tokens a sealed block
    trails by, as the server requires)."""
    for spec in (None, {"kind": "lookup", "k": 4}):
        with _start(loaded, max_batch=4, max_queue=16, max_tokens=100, max_seq_len=256, block_size=4, kv=INT8,
                    spec=spec) as srv:
            storage = srv.state.scheduler.cache.storage
            assert storage.kind == "quantized" and storage.bits == 8
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            with ThreadPoolExecutor(len(REPEATING)) as pool:
                texts = list(pool.map(lambda job: _stream_text(client, *job), REPEATING))
            assert all(texts)
            _wait_idle(srv)
            assert any(storage.sealed), "no block was ever quantized: the test lost its point"
            finished = _metric(srv, "specquant_sequences_finished_total")
            assert finished == len(REPEATING)
            if spec:
                assert srv.state.scheduler.spec_rounds > 0
            _assert_pool_empty(srv.state.scheduler)


@pytest.mark.parametrize("chunk,slots", [(512, 12), (8, 7)], ids=["whole-prompt", "chunked"])
def test_int8_kv_staging_exhaustion_requeues_the_prefill(tiny_model, monkeypatch, chunk, slots):
    """Too few full-precision staging slots for everyone: a prefill that finds none goes back to the head of the
    queue (also between two chunks of one prompt), a decode step that finds none preempts; every request still
    finishes and the pool empties."""
    from toolkit.serve import kv_pool
    from toolkit.serve import scheduler as scheduler_module
    from toolkit.serve.scheduler import Limits, Scheduler

    monkeypatch.setattr(scheduler_module, "QUANTIZED_PREFILL_CHUNK", chunk)

    model, tokenizer = tiny_model
    build = kv_pool.paged_cache_for
    monkeypatch.setattr(kv_pool, "paged_cache_for", lambda model, kv, blocks, size, prefix, **_: build(
        model, kv, blocks, size, prefix, staging_slots=slots))
    monkeypatch.setattr(Scheduler, "_staging_allows", lambda self, tokens: True)  # admit blindly: prefills fail
    # prompts of 20-44 tokens: 5-11 blocks of 4 to stage at prefill; each running sequence keeps 3-4 staged
    prompts = [(PROMPTS[i], MAX_TOKENS[i]) for i in (2, 6, 8, 9, 4)]
    limits = Limits(max_batch=4, max_queue=16, max_kv_tokens=400, max_seq_len=256, block_size=4, kv=INT8)
    scheduler, done, _ = _run_scheduler(model, tokenizer, limits, prompts)
    assert scheduler.cache.storage.staging_slots == slots
    assert scheduler.requeued > 0, "no prefill ran out of staging slots: the test lost its point"
    assert [d["type"] for d in done] == ["done"] * len(prompts)
    assert all(d["finish_reason"] in ("stop", "length") for d in done)
    _assert_pool_empty(scheduler)


@pytest.mark.real_model
def test_smollm2_spec_lookup_and_int8_kv(smollm2):
    """The real model: spec=lookup over the fp pool gives exactly generate()'s greedy tokens (drafts accepted on
    these prompts, which quote their system prompt); on an INT8 KV pool (residual 32, so most of each 100+ token
    context is read back quantized) the greedy outputs share most of their tokens with full precision, with and
    without speculation."""
    from toolkit.serve.scheduler import Limits

    model, tokenizer = smollm2.model, smollm2.tokenizer
    prompts = [(f"{SYSTEM}\nQuestion: {q}\nAnswer:", 40) for q in QUESTIONS[:3]]
    expected = [generate(model, tokenizer, [p], n).sequences[0].token_ids for p, n in prompts]
    total = sum(len(e) for e in expected)

    def run(kv, spec):
        limits = Limits(max_batch=4, max_queue=8, max_kv_tokens=4096, max_seq_len=512, block_size=16, kv=kv)
        scheduler, done, _ = _run_scheduler(model, tokenizer, limits, prompts, spec=spec)
        _assert_pool_empty(scheduler)
        return scheduler, [d["token_ids"] for d in done]

    scheduler, fp_spec = run(None, _lookup(k=4))
    assert fp_spec == expected
    assert scheduler.spec_accepted > 0
    print(f"\nfp + spec=lookup k=4: {scheduler.spec_accepted}/{scheduler.spec_proposed} drafted tokens accepted")
    for spec in (None, _lookup(k=4)):
        _, ids = run(KVSpec.from_node({"kind": "int8", "residual": 32}), spec)
        same = sum(a == b for got, want in zip(ids, expected) for a, b in zip(got, want))
        print(f"int8 KV{' + spec=lookup' if spec else ''} vs fp: {same}/{total} tokens agree position by position")
        assert same >= 0.75 * total
