"""Windowed caches (kv.window, kv.sink; toolkit/kv/window.py): each token reads the sinks and the recent tokens the
policy keeps -- the logits of a masked full forward with exactly that span --, the sinks' keys are turned as RoPE
would have turned them further on, the native stack reads a window as the torch path does, generation runs past
the model's context in constant memory, and what a window cannot do is refused with the fix."""

import copy
import dataclasses

import pytest
import torch

from toolkit.engine.generate import decode_step, generate, prefill
from toolkit.engine.lean_forward import install
from toolkit.engine.native_decoder import NativeDecoder, library
from toolkit.engine.precision import Precision, prepare_model
from toolkit.errors import InputError
from toolkit.evaluation.forward import window_logits
from toolkit.kv import ContiguousKVCache, KVSpec, QuantizedKVCache, make_kv_cache, window
from toolkit.kv.config import KVQuantConfig
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
    with pytest.raises(InputError, match="whole key groups") as err:
        KVSpec.from_node({"kind": "int4", "window": 8})
    assert "kv.window >= 160" in err.value.fix
    with pytest.raises(InputError, match="pre_rope") as err:
        KVSpec.from_node({"kind": "int2", "window": 2048})
    assert "kv.pre_rope=false" in err.value.fix
    with pytest.raises(InputError, match="spec=none"):
        KVSpec(window=8).with_rollback(5, "speculative decoding")
    with pytest.raises(InputError, match="one at a time"):
        generate(model, tokenizer, [[5, 6, 7], [5, 6]], 4, kv=KVSpec(window=8))
    assert KVSpec.from_node({"kind": "fp", "window": 8, "sink": 2}) == KVSpec(window=8, sink=2)


@pytest.mark.skipif(library() is None, reason="the native decoder is not built here")
@pytest.mark.parametrize("kv", [{"kind": "fp", "dtype": "fp16", "window": 24},
                                {"kind": "int4", "window": 48, "residual": 16, "group_size": 16}])
def test_the_native_stack_reads_a_window_as_the_torch_path_does(tiny_wide_llama, monkeypatch, kv):
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
    spec = KVSpec.from_node(kv)
    ids = torch.randint(5, 200, (1, 60), generator=torch.Generator().manual_seed(0))
    logits = []
    for model in (native, lean):
        cache = make_kv_cache(model, 400, spec)
        out = [prefill(model, ids, None, torch.arange(60)[None], cache)]
        token = out[0].argmax(-1, keepdim=True)
        for p in range(60, 200):
            out.append(decode_step(model, token, None, torch.tensor([[p]]), cache))
            token = out[-1].argmax(-1, keepdim=True)
        logits.append(torch.cat(out))
        assert cache.layers[0].dropped > 0
    assert len(calls) >= 140  # every decode step, and the prompt's pieces, ran on the stack
    torch.testing.assert_close(logits[0], logits[1], atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_quantized_window_holds_what_the_full_cache_holds_for_the_kept_tokens(bits):
    """Fed the same keys and values in uneven pieces, a windowed KIVI cache reads, at every length, exactly the full
    cache's reading with the dropped tokens taken out: codes, scales, staged keys, full-precision window and sinks
    all moved intact (sinks unturned here: no frequencies given)."""
    cfg = KVQuantConfig(bits=bits, group_size=16, residual=24, sink=3)
    spec = KVSpec({8: "int8", 4: "int4", 2: "int2"}[bits], dataclasses.replace(cfg, pre_rope=False), window=40)
    shape = spec.window_shape()
    assert (shape.sink, shape.align) == (16, 32)  # the head: the sinks rounded up to a key group
    windowed = QuantizedKVCache(1, shape.capacity, dataclasses.replace(cfg, sink=shape.sink), None, shape)
    full = QuantizedKVCache(1, 1000, dataclasses.replace(cfg, sink=shape.sink))
    gen = torch.Generator().manual_seed(bits)
    length, drops = 0, 0
    for rows in [7, 1, 30, 1, 1, 40, 3, 1, 40, 1, 1, 1, 40, 17, 1, 40, 40, 2, 1, 1, 40]:
        k, v = torch.randn(2, 1, 2, rows, 32, generator=gen)
        windowed.make_room(rows)
        windowed.update(k, v, 0)
        full.update(k, v, 0)
        length += rows
        dropped = windowed.layers[0].dropped
        drops += dropped > 0
        assert windowed.position == length and windowed.length == length - dropped <= shape.capacity
        got = windowed.layers[0].attention_view(0)
        want = full.layers[0].attention_view(0)
        for g, w in zip(got, want):
            kept = torch.cat([w[:, :, :shape.sink], w[:, :, shape.sink + dropped:]], dim=2)
            torch.testing.assert_close(g, kept, atol=0, rtol=0)
    assert drops and windowed.layers[0].nbytes < full.layers[0].nbytes


def test_quantized_windows_on_the_model(llama):
    """int8 with a window (a head of one key group): its logits are as far from a float cache windowed the same way
    (same head, drops at the same steps) as the full int8 cache's are from the full float cache's (int8 keys'
    error on this random tiny model, ~0.3 in logits); a token read from a wrong slot would be far off."""
    model, _ = llama
    ids = torch.randint(5, model.config.vocab_size, (1, 592), generator=torch.Generator().manual_seed(1))
    spec = KVSpec.from_node({"kind": "int8", "window": 160, "sink": 16})
    windowed = make_kv_cache(model, 600, spec)
    assert windowed.call_rows == 160

    def logits(cache):
        out = []
        for start in range(0, 592, 16):
            cache.make_room(16)
            out.append(model(input_ids=ids[:, start:start + 16], position_ids=torch.arange(start, start + 16)[None],
                             cache=cache).logits)
        return torch.cat(out, 1)

    with torch.no_grad():
        window_error = (logits(windowed) - logits(ContiguousKVCache.windowed(model, spec.window_shape()))).abs()
        full_error = (logits(make_kv_cache(model, 600, KVSpec("int8"))) - logits(make_kv_cache(model, 600))).abs()
    assert windowed.layers[0].dropped > 0
    assert window_error.max() < 1.5 * full_error.max() and window_error.mean() < 1.5 * full_error.mean()
