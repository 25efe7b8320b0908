"""Windowed caches (kv.window, kv.sink; toolkit/kv/window.py): each token reads the sinks and the recent tokens the
policy keeps -- the logits of a masked full forward with exactly that span --, the sinks' keys are turned as RoPE
would have turned them further on, the native stack reads a window as the torch path does, generation runs past
the model's context in constant memory, and what a window cannot do is refused with the fix."""

import copy

import pytest
import torch

from toolkit.engine.generate import decode_step, generate, prefill
from toolkit.engine.lean_forward import install
from toolkit.engine.native_decoder import NativeDecoder, library
from toolkit.engine.precision import Precision, prepare_model
from toolkit.errors import InputError
from toolkit.evaluation.forward import window_logits
from toolkit.kv import KVSpec, make_kv_cache, window
from toolkit.kv.window import Window, turn_keys


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    install(model, "lean")
    return model, AutoTokenizer.from_pretrained(tiny_llama_dir)


def test_turning_a_key_is_rope_at_the_later_position(llama):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rotary = llama[0].model.rotary_emb
    raw = torch.randn(1, 2, 3, 16)

    def rope(positions):
        cos, sin = rotary(raw, torch.tensor([positions]))
        return apply_rotary_pos_emb(raw, raw, cos, sin)[0]

    turned = turn_keys(rope([0, 1, 2]), 300, rotary.inv_freq)
    torch.testing.assert_close(turned, rope([300, 301, 302]), atol=1e-5, rtol=1e-5)


def _visible(length: int, chunk: int, w: Window) -> torch.Tensor:
    """[T, T] which keys each query reads when a window is fed `chunk` tokens a call, simulated from the policy
    alone: the sinks, and everything from the oldest kept token on (the last W once the cache had to drop)."""
    mask = torch.zeros(length, length, dtype=torch.bool)
    held, oldest = 0, w.sink
    for start in range(0, length, chunk):
        rows = min(chunk, length - start)
        if held + rows > w.capacity:
            held, oldest = w.sink + w.size, start - w.size
        for p in range(start, start + rows):
            mask[p, :min(w.sink, p + 1)] = True
            mask[p, max(oldest, 0):p + 1] = True
        held += rows
    return mask


@pytest.mark.parametrize("sink, chunk", [(0, 1), (0, 5), (3, 1), (3, 7)])
def test_each_token_reads_what_the_window_keeps(llama, monkeypatch, sink, chunk):
    """Logits through a sliding window equal one forward over the whole text masked to the span the policy keeps
    (sinks unturned here, as the masked forward cannot turn them; the turn has its own test)."""
    model, _ = llama
    monkeypatch.setattr(window, "turn_keys", lambda keys, delta, inv_freq: keys)
    spec = KVSpec(window=8, sink=sink)
    ids = torch.randint(5, model.config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(sink + chunk))
    got = window_logits(model, ids, spec, chunk)
    allowed = _visible(ids.shape[1], min(chunk, Window(8, sink).slack), Window(8, sink))
    assert not bool(allowed.tril().all())  # the window did slide
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=allowed[None, None], use_cache=False).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_the_sinks_are_turned_by_what_was_dropped(llama):
    model, _ = llama
    cache = make_kv_cache(model, 1000, KVSpec(window=8, sink=2))
    ids = torch.randint(5, model.config.vocab_size, (1, 40))
    window_logits(model, ids, KVSpec(window=8, sink=2), 4)  # the path itself; below, the same by hand
    first = None
    for start in range(0, 40, 4):
        cache.make_room(4)
        model(input_ids=ids[:, start:start + 4], position_ids=torch.arange(start, start + 4)[None], cache=cache)
        if first is None:
            first = cache.layers[0].key_buffer[:, :, :2].clone()
    layer = cache.layers[0]
    assert layer.dropped > 0 and cache.position == 40 and cache.length <= Window(8, 2).capacity
    torch.testing.assert_close(layer.key_buffer[:, :, :2], turn_keys(first, layer.dropped, layer.inv_freq))


def test_a_window_that_never_fills_is_the_full_cache(llama):
    model, _ = llama
    ids = torch.randint(5, model.config.vocab_size, (2, 30))
    assert make_kv_cache(model, 30, KVSpec(window=40)).call_rows is None
    torch.testing.assert_close(window_logits(model, ids, KVSpec(window=40), 6),
                               window_logits(model, ids, KVSpec(), 6), atol=0, rtol=0)


def test_generation_runs_past_the_context_in_constant_memory(llama):
    model, tokenizer = llama
    spec = KVSpec(window=16, sink=4)
    prompt = list(range(5, 5 + 100))  # longer than one call takes: fed in pieces
    long = model.config.max_position_embeddings
    with pytest.raises(InputError, match="context"):
        generate(model, tokenizer, [prompt], long)
    out = generate(model, tokenizer, [prompt], long, stop_tokens=set(), kv=spec)
    assert len(out.sequences[0].token_ids) == long
    per_token = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, fp32
    assert out.kv_bytes <= Window(16, 4).capacity * per_token


def test_what_a_window_refuses(llama):
    model, tokenizer = llama
    with pytest.raises(InputError, match="kv=fp kv.window=8"):
        KVSpec.from_node({"kind": "int4", "window": 8})
    with pytest.raises(InputError, match="spec=none"):
        KVSpec(window=8).with_rollback(5, "speculative decoding")
    with pytest.raises(InputError, match="one at a time"):
        generate(model, tokenizer, [[5, 6, 7], [5, 6]], 4, kv=KVSpec(window=8))
    assert KVSpec.from_node({"kind": "fp", "window": 8, "sink": 2}) == KVSpec(window=8, sink=2)


@pytest.mark.skipif(library() is None, reason="the native decoder is not built here")
def test_the_native_stack_reads_a_window_as_the_torch_path_does(tiny_wide_llama, monkeypatch):
    native, lean = copy.deepcopy(tiny_wide_llama), copy.deepcopy(tiny_wide_llama)
    for model in (native, lean):
        prepare_model(model, Precision(torch.float32, torch.float16), gemm="fbgemm")
    install(native)
    install(lean, "lean")
    if native.forward.native_decoder() is None:
        pytest.skip(f"the native decoder does not run this model here: {native.forward.native_reason}")
    calls = []
    real = NativeDecoder.run
    monkeypatch.setattr(NativeDecoder, "run", lambda self, *a: calls.append(1) or real(self, *a))
    spec = KVSpec(dtype="fp16", window=24, sink=4)
    ids = torch.randint(5, 200, (1, 60), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (native, lean):
        cache = make_kv_cache(model, 200, spec)
        out = [prefill(model, ids, None, torch.arange(60)[None], cache)]
        token = out[0].argmax(-1, keepdim=True)
        for p in range(60, 130):
            out.append(decode_step(model, token, None, torch.tensor([[p]]), cache))
            token = out[-1].argmax(-1, keepdim=True)
        logits.append(torch.cat(out))
        assert cache.layers[0].dropped > 0
    assert len(calls) >= 70  # every decode step, and the prompt's pieces, ran on the stack
    torch.testing.assert_close(logits[0], logits[1], atol=2e-3, rtol=1e-3)
