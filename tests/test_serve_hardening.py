"""The server under hostile or unlucky input: no accepted setting makes sampling produce inf/NaN, every bad request is
an OpenAI-style JSON 4xx on a connection that stays usable, one request's failure inside the batch ends that request
only, a client that leaves (streaming or not) frees its row and blocks, bodies over the limit are refused before they
are read, and a draining server refuses new work and ends what is left with finish_reason "abort".

No pass/fail here depends on timing: waits are bounded loops on observable state (/health, the scheduler's lists).
Servers bind 127.0.0.1 only."""

import http.client
import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from omegaconf import OmegaConf

from tests.test_serve import _start
from toolkit.engine.generate import generate
from toolkit.engine.sampling import GREEDY_BELOW, SamplingParams, probabilities, sample
from toolkit.serve.server import drain

MODEL = "tiny"
PROMPTS = ["The class statement", "def f(x): return", "import os", "while True:", "yield",
           "Lambda expressions are used to create anonymous functions"]
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(loaded):
    with _start(loaded, max_batch=4, max_queue=16, max_tokens=500, max_seq_len=512, max_body_mb=0.5) as srv:
        yield srv


def _engine_text(loaded, prompt, max_tokens):
    return generate(loaded.model, loaded.tokenizer, [prompt], max_tokens).sequences[0].text


def _health(server) -> dict:
    return httpx.get(server.url + "/health").json()


def _wait(predicate, what: str, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.01)


def _metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _assert_idle_and_pool_empty(server) -> None:
    scheduler = server.state.scheduler
    _wait(lambda: scheduler.idle, "the scheduler went idle")
    health = _health(server)
    assert health["running"] == 0 and health["waiting"] == 0
    pool = scheduler.cache.pool
    _wait(lambda: pool.used == 0, "every block went back")
    assert pool.available == pool.num_blocks
    assert _health(server)["kv_blocks_free"] == _health(server)["kv_blocks_total"] == pool.num_blocks
    assert all(count == 0 for count in pool.ref_count)
    pool.check()


def _assert_openai_error(response, status, param="?", code="?"):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "?":
        assert error["param"] == param, error
    if code != "?":
        assert error["code"] == code, error


# --- 1. sampling cannot produce inf/NaN ----------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [8e-38, 1e-45, 1e-300, 5e-324, GREEDY_BELOW / 2])
def test_tiny_temperatures_decode_greedily(temperature):
    logits = torch.randn(4, 300) * 40
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=10, seed=1)
    assert params.greedy
    assert sample(logits, params, params.generator()).tolist() == logits.argmax(-1).tolist()


def test_sampling_never_yields_an_invalid_distribution():
    logits = torch.randn(3, 200) * 1e30  # dividing by the temperature would overflow float32
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    for temperature in (GREEDY_BELOW, 1e-3, 0.7, 2.0):
        params = SamplingParams(temperature=temperature, top_p=0.9, top_k=50)
        probs = probabilities(logits, params)
        assert torch.isfinite(probs).all() and (probs >= 0).all()
        assert torch.allclose(probs.sum(-1), torch.ones(3))
        sample(logits, params, torch.Generator().manual_seed(0))  # no "probability tensor contains inf/nan"
    for bad in (float("nan"), float("inf")):
        with pytest.raises(Exception, match="finite"):
            SamplingParams(temperature=bad)


def test_tiny_temperature_over_http_equals_greedy(server, loaded):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12}
    texts = [httpx.post(server.url + "/v1/completions", json={**body, "temperature": t}, timeout=60).json()
             for t in (1e-45, 8e-38, 1e-300)]
    assert [t["choices"][0]["text"] for t in texts] == [_engine_text(loaded, PROMPTS[0], 12)] * 3


NUMBERS = [  # raw JSON bodies: NaN/Infinity literals and integers too large for any C type
    (b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": NaN}', "top_p"),
    (b'{"model": "tiny", "prompt": "hi", "top_p": -Infinity}', "top_p"),
    (b'{"model": "tiny", "prompt": "hi", "seed": 18446744073709551616}', "seed"),
    (b'{"model": "tiny", "prompt": "hi", "seed": -9223372036854775809}', "seed"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 1000000000000000000000000000000}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": 1e300}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "hi", "top_k": 99999999999999999999999999}', "top_k"),
    (b'{"model": "tiny", "prompt": "hi", "temperature": ' + b"9" * 400 + b"}", "temperature"),
    (b'{"model": "tiny", "prompt": "hi", "max_tokens": NaN}', "max_tokens"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', "top_p"),
]


@pytest.mark.parametrize("raw,param", NUMBERS, ids=[p + str(i) for i, (_, p) in enumerate(NUMBERS)])
def test_non_finite_and_huge_numbers_are_400_naming_the_field(server, raw, param):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    _assert_openai_error(httpx.post(server.url + path, content=raw, headers=JSON, timeout=30), 400, param)


# --- 3. every error path: OpenAI-style JSON, right status, connection kept -----------------------------------------

ERRORS = [  # (method, path, raw body, content type, status, param)
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "application/json", 400, "messages[0].content"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "a\\udfffb"}', "application/json", 400, "prompt"),
    ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, "application/json", 400, None),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "application/json",
     400, "?"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "seed": 18446744073709551616}',
     "application/json", 400, "seed"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "top_p": NaN}', "application/json", 400, "top_p"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', "text/plain", 415, None),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', None, 415, None),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi"}', "application/x-www-form-urlencoded", 415, None),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}',
     "application/json", 400, "messages[0].role"),
    ("POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "tool", "content": "hi"}]}',
     "application/json", 400, "messages[0].role"),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "\\ud800": 1}', "application/json", 400, "?"),
    ("POST", "/v1/completions", b"\xff\xfe\x00garbage", "application/json", 400, None),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "hi", "x": ' + b"1" * 5000 + b"}",
     "application/json", 400, None),
    ("GET", "/v1/models/nope", b"", None, 404, "model"),
    ("GET", "/v1/completions", b"", None, 405, None),
    ("GET", "/nowhere", b"", None, 404, None),
]


def test_every_error_is_openai_json_on_a_connection_that_stays_open(server, loaded):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
        sock = conn.sock
        for method, path, raw, ctype, status, param in ERRORS:
            headers = {"content-type": ctype} if ctype else {}
            conn.request(method, path, body=raw if method == "POST" else None, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            assert response.status == status, (path, raw[:80], payload[:300])
            assert response.getheader("content-type", "").startswith("application/json")
            error = json.loads(payload)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
            if param != "?":
                assert error["param"] == param, (raw[:80], error)
            assert conn.sock is sock, f"the connection was closed after {status} for {raw[:60]!r}"
        body = json.dumps({"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0})
        conn.request("POST", "/v1/completions", body=body, headers=JSON)
        response = conn.getresponse()
        assert response.status == 200
        assert json.loads(response.read())["choices"][0]["text"] == _engine_text(loaded, PROMPTS[2], 6)
        assert conn.sock is sock
    finally:
        conn.close()


def test_models_by_id(server):
    assert httpx.get(server.url + "/v1/models/" + MODEL).json() == httpx.get(server.url + "/v1/models").json()["data"][0]
    _assert_openai_error(httpx.get(server.url + "/v1/models/org/other"), 404, "model", "model_not_found")


def test_unexpected_exception_is_a_json_500_and_the_connection_survives(server, monkeypatch):
    from toolkit.serve import app as app_module

    def boom(raw):
        raise RuntimeError("an unexpected bug")

    monkeypatch.setattr(app_module, "_decode_json", boom)
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=b"{}", headers=JSON)
        response = conn.getresponse()
        assert response.status == 500
        assert json.loads(response.read())["error"]["type"] == "server_error"
        sock = conn.sock
        monkeypatch.undo()
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200 and conn.sock is sock
    finally:
        conn.close()


# --- 5. body size limit --------------------------------------------------------------------------------------------

def test_oversized_bodies_get_413(server):
    limit = server.state.max_body_bytes
    # declared too large: answered from the headers, before a byte of the body is sent
    with socket.create_connection((server.host, server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000000\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(payload)["error"]["code"] == "request_too_large"
    # no Content-Length (chunked): counted while it streams in
    pieces = (b'{"model": "tiny", "prompt": "' + b"x" * (limit // 4),) + (b"x" * (limit // 4),) * 5 + (b'"}',)
    response = httpx.post(server.url + "/v1/completions", content=iter(pieces), headers=JSON, timeout=60)
    _assert_openai_error(response, 413, None, "request_too_large")
    # just under the limit: read and answered normally (here: too many tokens for the context)
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x " * (limit // 3)},
                          timeout=60)
    _assert_openai_error(response, 400, "prompt", "context_length_exceeded")


# --- 2. fault isolation in the batch -------------------------------------------------------------------------------

def _run(loaded, jobs, limits=None, spec=None):
    """Every (prompt, max_tokens) submitted at once to a Scheduler; its final events, in order."""
    from toolkit.engine.generate import stop_token_ids
    from toolkit.serve.metrics import ServerMetrics
    from toolkit.serve.scheduler import Limits, Scheduler
    from toolkit.serve.sequence import Sequence

    model, tokenizer = loaded.model, loaded.tokenizer
    scheduler = Scheduler(model, tokenizer, stop_token_ids(model, tokenizer), limits or Limits(4, 16, 4096, 256),
                          ServerMetrics(), spec)
    done, finished = {}, threading.Event()

    def emitter(i):
        def emit(event):
            if event["type"] in ("done", "error"):
                done[i] = event
                if len(done) == len(jobs):
                    finished.set()
        return emit

    seqs = [Sequence(tokenizer(p).input_ids, n, SamplingParams(), [], emitter(i)) for i, (p, n) in enumerate(jobs)]
    scheduler.start()
    try:
        for seq in seqs:
            scheduler.submit(seq)
        assert finished.wait(120)
    finally:
        scheduler.stop()
    return scheduler, seqs, [done[i] for i in range(len(jobs))]


JOBS = [(PROMPTS[i], n) for i, n in zip(range(4), (20, 14, 24, 18))]


@pytest.mark.parametrize("where", ["sampling", "forward"])
def test_one_failing_row_leaves_the_others_exact(loaded, monkeypatch, where):
    """One request fails mid-batch (its sampling raises, or every model call that includes it does): it ends with an
    error event, the others keep their KV state and decode exactly their solo greedy tokens."""
    from toolkit.serve.scheduler import Scheduler

    victim = loaded.tokenizer(JOBS[2][0]).input_ids  # the third request of the batch
    sample_row, forward = Scheduler._sample, Scheduler._forward

    def failing_sample(self, seq, logits):
        if seq.prompt_ids == victim and len(seq.generated) >= 5:
            raise RuntimeError("injected sampling failure")
        return sample_row(self, seq, logits)

    def failing_forward(self, seqs, new_tokens, keep=1):
        if any(s.prompt_ids == victim and len(s.generated) >= 5 for s in seqs):
            raise RuntimeError("injected forward failure")
        return forward(self, seqs, new_tokens, keep)

    monkeypatch.setattr(Scheduler, "_sample" if where == "sampling" else "_forward",
                        failing_sample if where == "sampling" else failing_forward)
    scheduler, _, done = _run(loaded, JOBS)
    assert scheduler.peak_batch == len(JOBS)
    _only_the_victim_failed(loaded, scheduler, done, JOBS)


# --- 4. cancellation on disconnect ---------------------------------------------------------------------------------

def test_non_streaming_client_that_leaves_is_cancelled(server):
    """A non-streaming request whose client goes away stops at the next turn (not at max_tokens); its row and blocks
    come back."""
    cancelled = _metric(server, 'specquant_sequences_finished_total{reason="cancelled"}')
    finished_length = _metric(server, 'specquant_sequences_finished_total{reason="length"}')
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 500, "temperature": 0}).encode()
    sock = socket.create_connection((server.host, server.port), timeout=60)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        _wait(lambda: _health(server)["running"] == 1, "the request started")
        assert server.state.scheduler.running[0].generated  # decoding
    finally:
        sock.close()  # the client is gone
    _assert_idle_and_pool_empty(server)
    assert _metric(server, 'specquant_sequences_finished_total{reason="cancelled"}') == cancelled + 1
    assert _metric(server, 'specquant_sequences_finished_total{reason="length"}') == finished_length


def test_streaming_client_that_leaves_is_cancelled(server):
    cancelled = _metric(server, 'specquant_sequences_finished_total{reason="cancelled"}')
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 500, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i == 3:
                break
    _assert_idle_and_pool_empty(server)
    assert _metric(server, 'specquant_sequences_finished_total{reason="cancelled"}') == cancelled + 1


# --- 7. draining -----------------------------------------------------------------------------------------------------

def test_drain_aborts_what_is_left_and_refuses_new_requests(loaded):
    with _start(loaded, max_batch=4, max_tokens=500, max_seq_len=512) as srv:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 500, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)  # running
            with ThreadPoolExecutor(1) as pool:
                aborted = pool.submit(drain, srv.state, 0.0)
                rest = [line for line in lines if line]
                assert aborted.result() == 1
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2][len("data: "):])
        assert last["choices"][0]["finish_reason"] == "abort"
        assert 0 < last["usage"]["completion_tokens"] < 500
        refused = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
        _assert_openai_error(refused, 503, None, "server_shutting_down")
        assert _health(srv)["status"] == "draining"
        _assert_idle_and_pool_empty(srv)


def test_drain_lets_running_requests_finish_within_the_timeout(loaded):
    with _start(loaded, max_batch=4, max_tokens=100, max_seq_len=256) as srv:
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(httpx.post, srv.url + "/v1/completions", json=body, timeout=60)
            _wait(lambda: srv.state.scheduler.running or reply.done(), "the request started")
            assert drain(srv.state, 120.0) == 0  # nothing left to abort: it finished
            result = reply.result().json()
        assert result["choices"][0]["finish_reason"] in ("length", "stop")  # not "abort"
        assert result["choices"][0]["text"] == _engine_text(loaded, PROMPTS[1], 30)


def test_sigterm_drains_then_stops_the_server(loaded):
    """What the first SIGTERM does (the handler called directly: no signal is sent): a stream still running when the
    drain timeout (0 here) passes gets a final "abort" chunk and [DONE], then uvicorn stops."""
    srv = _start(loaded, max_batch=4, max_tokens=500, max_seq_len=512, drain_timeout_s=0)
    with srv:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 500, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            srv.server.handle_exit(signal.SIGTERM, None)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["choices"][0]["finish_reason"] == "abort"
        srv.thread.join(60)
        assert not srv.thread.is_alive(), "uvicorn did not stop after the drain"
        assert srv.state.scheduler.idle


def test_a_prompt_far_over_the_context_is_refused_without_tokenizing_all_of_it(loaded):
    """A megabyte prompt is refused once a prefix proves it too long, for completions and chat alike."""
    from toolkit.serve.protocol import APIError, parse_chat, parse_completion

    seen = []

    class Recording:
        chat_template = loaded.tokenizer.chat_template

        def __call__(self, text, **kwargs):
            seen.append(len(text))
            return loaded.tokenizer(text, **kwargs)

        def apply_chat_template(self, *args, **kwargs):
            return loaded.tokenizer.apply_chat_template(*args, **kwargs)

        def __len__(self):
            return len(loaded.tokenizer)

    text = "hello world, " * 80_000  # ~1 MB
    for parse, body, param in ((parse_completion, {"prompt": text}, "prompt"),
                               (parse_chat, {"messages": [{"role": "user", "content": text}]}, "messages")):
        seen.clear()
        with pytest.raises(APIError) as err:
            parse(body, Recording(), 100, 512)
        assert (err.value.status, err.value.param, err.value.code) == (400, param, "context_length_exceeded")
        assert seen and max(seen) < len(text) // 10
    # a prompt just over the context is still counted exactly (and refused)
    with pytest.raises(APIError, match="context") as err:
        parse_completion({"prompt": "word " * 600}, Recording(), 100, 512)
    assert err.value.code == "context_length_exceeded"


def test_one_failing_row_in_a_verify_pass_leaves_the_others_exact(loaded, monkeypatch):
    """spec=lookup: the victim's share of a batched verify pass raises; the other rows keep their accepted drafts and
    decode exactly generate()'s greedy tokens."""
    from toolkit.serve.scheduler import Limits, Scheduler
    from toolkit.serve.speculation import serve_spec

    jobs = [("one two three four one two three four one two three", 24), ("a b a b a b a b a", 31),
            ("def f(x): return x\ndef g(x): return", 17), ("while True: while True:", 20)]
    victim = loaded.tokenizer(jobs[2][0]).input_ids
    keep = Scheduler._keep_verified
    calls = {"victim": 0}

    def failing(self, seq, drafted, row_logits, length):
        if seq.prompt_ids == victim and drafted:
            calls["victim"] += 1
            raise RuntimeError("injected verify failure")
        return keep(self, seq, drafted, row_logits, length)

    monkeypatch.setattr(Scheduler, "_keep_verified", failing)
    spec = serve_spec(OmegaConf.create({"kind": "lookup", "k": 4, "ngram_max": 3, "ngram_min": 1}), 4)
    scheduler, _, done = _run(loaded, jobs, Limits(4, 16, 4096, 256, block_size=4), spec)
    assert calls["victim"] == 1 and scheduler.spec_rounds > 0 and scheduler.spec_accepted > 0
    _only_the_victim_failed(loaded, scheduler, done, jobs)


def _only_the_victim_failed(loaded, scheduler, done, jobs):
    """Row 2 (the injected failure) ended with an error; rows 0, 1, 3 equal their solo outputs; every block is free."""
    assert done[2]["type"] == "error" and "injected" in done[2]["message"]
    expected = [generate(loaded.model, loaded.tokenizer, [p], n).sequences[0].token_ids for p, n in jobs]
    for i in (0, 1, 3):
        assert done[i]["type"] == "done" and done[i]["token_ids"] == expected[i]
    pool = scheduler.cache.pool
    assert pool.used == 0 and all(c == 0 for c in pool.ref_count)
    pool.check()
