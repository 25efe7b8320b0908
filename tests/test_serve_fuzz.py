"""Property-based fuzzing of the HTTP layer (hypothesis, in-process through starlette's TestClient): whatever body a
client sends -- wrong types, extreme numbers, NaN/inf, huge and nested values, odd unicode, lone surrogates -- the
server answers with no 5xx, every 4xx carries an OpenAI-style JSON error body, and a greedy request served in between
the fuzzed ones (and one running beside them on another thread) still gets exactly its solo output.

Bounded: a few hundred examples, derandomized (the same examples every run), a server whose max_tokens and context are
small so an accepted fuzzed request costs a few decode steps."""

import json
import threading
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.serve.app import create_app
from toolkit.serve.server import ServeSettings, build_state

MODEL = "tiny"
GREEDY = {"model": MODEL, "prompt": "def f(x): return", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def app_client(chat_model_dir):
    from fastapi.testclient import TestClient

    engine = EngineSpec(dtype="fp32", threads=None, compile=False)
    loaded = load_engine_model(str(chat_model_dir), engine)
    state = build_state(loaded, ServeSettings(model_id=MODEL, max_batch=4, max_queue=64, max_tokens=8,
                                              max_seq_len=128, max_body_mb=1))
    state.scheduler.start()
    try:
        with TestClient(create_app(state), raise_server_exceptions=False) as client:
            yield client, state
    finally:
        state.scheduler.stop()


def _greedy_text(client) -> str:
    response = client.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


NUMBERS = (st.integers(min_value=-2**70, max_value=2**70)
           | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, -2**63 - 1, 10**30, 10**400])
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([1e-45, 8e-38, 1e-300, 5e-324, 1e-4, 2.0, 2.0000001, -0.0, 1e308]))
TEXT = st.text(st.characters(codec=None, categories=None, exclude_categories=()), max_size=12) | st.sampled_from(
    ["", "\ud800", "a\udfffb", "\u0000", "\U0001F600" * 3, "\u202e", "</s>", "<s>assistant:", "x" * 300, "y " * 50_000])
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                      max_leaves=12)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", ""])
                                 | VALUES, "content": TEXT | VALUES})
FIELDS = {  # the fields the routes read, with values that are sometimes right and often wrong
    "model": st.just(MODEL) | VALUES,
    "prompt": TEXT | st.lists(st.integers(min_value=-5, max_value=600), max_size=20) | VALUES,
    "messages": st.lists(MESSAGE, max_size=3) | VALUES,
    "max_tokens": NUMBERS | VALUES, "max_completion_tokens": NUMBERS,
    "temperature": NUMBERS | VALUES, "top_p": NUMBERS, "top_k": NUMBERS, "seed": NUMBERS | VALUES,
    "stop": TEXT | st.lists(TEXT, max_size=5) | VALUES, "stream": st.booleans() | VALUES,
    "stream_options": st.fixed_dictionaries({"include_usage": VALUES}) | VALUES,
    "n": NUMBERS, "logprobs": VALUES, "echo": VALUES, "user": VALUES, "logit_bias": VALUES,
    "presence_penalty": NUMBERS, "response_format": VALUES, "tools": VALUES,
}
PLAIN = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)  # encodable text (odd unicode included)
SANE = {  # values the server accepts
    "max_tokens": st.integers(1, 8), "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-45, 8e-38, 1e-300]),
    "top_p": st.floats(0, 1), "top_k": st.integers(0, 2**31 - 1), "seed": st.integers(-2**63, 2**64 - 1),
    "stop": st.lists(PLAIN, max_size=4), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
COMPLETION = st.fixed_dictionaries({"model": st.just(MODEL), "prompt": PLAIN | st.lists(st.integers(0, 511),
                                                                                         min_size=1, max_size=20)},
                                   optional=SANE)
CHAT = st.fixed_dictionaries({"model": st.just(MODEL), "messages": st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": PLAIN}), min_size=1, max_size=3)},
    optional=SANE)


@st.composite
def mutated(draw, base):
    """A body the server would accept, with up to two fields replaced by anything at all."""
    body = dict(draw(base))
    for key in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2)):
        body[key] = draw(FIELDS[key] | VALUES)
    return body


REQUESTS = st.one_of(  # (route, body): sane, sane but for a field or two, or anything
    st.tuples(st.just("/v1/completions"), COMPLETION), st.tuples(st.just("/v1/chat/completions"), CHAT),
    st.tuples(st.just("/v1/completions"), mutated(COMPLETION)),
    st.tuples(st.just("/v1/chat/completions"), mutated(CHAT)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
              st.fixed_dictionaries({}, optional=FIELDS) | st.dictionaries(TEXT, VALUES, max_size=3) | VALUES))


def test_fuzzed_bodies_never_5xx_and_never_disturb_a_greedy_request(app_client):
    client, state = app_client
    solo = _greedy_text(client)
    stop, beside = threading.Event(), []

    def alongside():  # a greedy request served over and over while the fuzzed ones come in (bounded)
        from fastapi.testclient import TestClient

        with TestClient(client.app, raise_server_exceptions=False) as other:
            for _ in range(400):
                if stop.is_set():
                    break
                beside.append(_greedy_text(other))

    thread = threading.Thread(target=alongside, daemon=True)
    thread.start()
    seen = {"n": 0}
    statuses = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(request=REQUESTS)
    def check(request):
        route, body = request
        raw = json.dumps(body, allow_nan=True).encode()
        response = client.post(route, content=raw, headers={"content-type": "application/json"})
        assert response.status_code < 500, (route, raw[:300], response.text[:300])
        statuses[response.status_code] += 1
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
        elif body.get("stream") is True if isinstance(body, dict) else False:
            assert response.text.rstrip().endswith("data: [DONE]")
        seen["n"] += 1
        if seen["n"] % 50 == 0:  # interleaved: the same greedy request between fuzzed ones
            assert _greedy_text(client) == solo

    try:
        check()
    finally:
        stop.set()
        thread.join(120)
    assert not thread.is_alive()
    print(f"fuzzed statuses: {dict(statuses)}; greedy requests beside them: {len(beside)}")
    assert statuses[200] > 0 and statuses[400] > 0  # some were accepted and ran, some were refused
    assert beside and set(beside) == {solo}
    assert _greedy_text(client) == solo
    scheduler = state.scheduler
    for _ in range(1000):  # bounded: the last fuzzed requests leave the batch
        if scheduler.idle and scheduler.cache.pool.used == 0:
            break
        threading.Event().wait(0.01)
    assert scheduler.idle and scheduler.cache.pool.used == 0


@pytest.mark.parametrize("raw", [b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" +
                                 b"}" * 50_000, b'"\\ud800"', b"\xed\xa0\x80", b"NaN", b"1" * 5000, b""])
def test_pathological_raw_bodies(app_client, raw):
    client, _ = app_client
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
