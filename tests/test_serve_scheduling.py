"""The server's scheduling: continuous batching changes nothing about what a request gets. Requests that join and
leave the running batch at different steps (sequences of different lengths in one paged KV pool) produce exactly what
the engine's own generate() gives (so the paged cache is checked against the engine's contiguous cache, not against
itself), on both architectures; so do requests that reuse a cached prompt prefix, requests preempted (and
recomputed) when a tiny pool runs out, and steps redone after an overflow. Every block goes back to the pool when its
request ends; the pool is sized by tokens or by megabytes.

Through the Scheduler itself (no HTTP) and through servers started here on loopback, over a tiny random llama in fp32
(and gemma3); the prompts and helpers come from test_serve.py, the served model from tests/conftest.py."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from tests.test_serve import (
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    QUESTIONS,
    SYSTEM,
    _assert_pool_empty,
    _engine_text,
    _metric,
    _run_scheduler,
    _start,
    _stream_text,
    _wait_idle,
)
from toolkit.engine.generate import generate
from toolkit.serve.server import ServeSettings, build_state


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
