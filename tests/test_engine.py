"""The engine: greedy output token-identical to transformers' generate() (fp32), batches of different lengths,
seeded sampling, stop tokens and strings, streaming, timing fields, bad input, the KV cache's crop."""

import pytest
import torch

from toolkit.engine import ContiguousKVCache, SamplingParams, generate
from toolkit.engine.precision import (
    HalfStorageLinear,
    Precision,
    exact_linears,
    prepare_model,
    resolve_precision,
)
from toolkit.engine.sampling import probabilities
from toolkit.errors import InputError
from toolkit.model_state import state_of

PROMPTS = ["The syntax of a function definition is", "A class is", "Iterators", "for x in range(10):",
           "The with statement is used to wrap the execution of a block with methods defined by a context manager"]


def hf_greedy(model, tokenizer, prompts, new_tokens):
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    return [row[enc.input_ids.shape[1]:].tolist() for row in out]


def cut_at_stop(tokens, stop):
    return tokens[:tokens.index(stop)] if stop in tokens else tokens


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_transformers_generate_one_prompt(tiny_model, prompt):
    model, tok = tiny_model
    ours = generate(model, tok, [prompt], 20).sequences[0]
    theirs = cut_at_stop(hf_greedy(model, tok, [prompt], 20)[0], tok.eos_token_id)
    assert ours.token_ids == theirs


def test_greedy_batch_of_different_lengths_matches_generate(tiny_model):
    model, tok = tiny_model
    lengths = {len(tok(p).input_ids) for p in PROMPTS}
    assert len(lengths) > 1
    ours = generate(model, tok, PROMPTS, 16)
    theirs = hf_greedy(model, tok, PROMPTS, 16)
    for seq, ref in zip(ours.sequences, theirs):
        assert seq.token_ids == cut_at_stop(ref, tok.eos_token_id)


def test_batch_rows_equal_single_runs(tiny_model):
    model, tok = tiny_model
    batch = generate(model, tok, PROMPTS[:3], 12).sequences
    for prompt, seq in zip(PROMPTS[:3], batch):
        assert generate(model, tok, [prompt], 12).sequences[0].token_ids == seq.token_ids


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_model):
    model, tok = tiny_model
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    a = generate(model, tok, PROMPTS[:2], 24, params, stop_tokens=set())
    b = generate(model, tok, PROMPTS[:2], 24, params, stop_tokens=set())
    c = generate(model, tok, PROMPTS[:2], 24, SamplingParams(1.0, 50, 0.9, seed=99), stop_tokens=set())
    assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
    assert [s.token_ids for s in a.sequences] != [s.token_ids for s in c.sequences]


def test_timing_fields_are_consistent(tiny_model):
    model, tok = tiny_model
    result = generate(model, tok, [PROMPTS[0]], 10, stop_tokens=set())
    timing = result.timing
    assert len(result.sequences[0].token_ids) == 10
    assert timing.new_tokens == 10 and len(timing.itl_s) == 9
    assert timing.ttft_s > 0 and all(t > 0 for t in timing.itl_s)
    summary = timing.summary()
    assert set(summary["itl_ms"]) == {"p50", "p90", "p99"}
    assert summary["itl_ms"]["p50"] <= summary["itl_ms"]["p90"] <= summary["itl_ms"]["p99"]
    assert summary["decode_tokens_per_s"] == pytest.approx(9 / sum(timing.itl_s))


def test_stop_token_ends_the_sequence(tiny_model):
    model, tok = tiny_model
    free = generate(model, tok, [PROMPTS[1]], 12, stop_tokens=set()).sequences[0]
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    seq = generate(model, tok, [PROMPTS[1]], 12, stop_tokens={stop}).sequences[0]
    assert seq.token_ids == free.token_ids[:first] and seq.finish_reason == "stop"


def test_stop_string_cuts_the_text(tiny_model):
    model, tok = tiny_model
    free = generate(model, tok, [PROMPTS[0]], 16, stop_tokens=set()).sequences[0]
    needle = free.text[len(free.text) // 2:len(free.text) // 2 + 2]
    assert needle.strip()
    seq = generate(model, tok, [PROMPTS[0]], 16, stop_strings=[needle], stop_tokens=set()).sequences[0]
    assert seq.finish_reason == "stop" and needle not in seq.text
    assert free.text.startswith(seq.text)


def test_streamed_text_never_shows_the_stop_string(tiny_model):
    model, tok = tiny_model
    free = generate(model, tok, [PROMPTS[0]], 16, stop_tokens=set()).sequences[0]
    needle = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    pieces = []
    seq = generate(model, tok, [PROMPTS[0]], 16, stop_strings=[needle], stop_tokens=set(),
                   on_token=lambda row, token, delta: pieces.append(delta)).sequences[0]
    assert "".join(pieces) == seq.text and needle not in seq.text


def test_streaming_callback_concatenates_to_the_text(tiny_model):
    model, tok = tiny_model
    pieces = {0: [], 1: []}
    result = generate(model, tok, PROMPTS[:2], 12, stop_tokens=set(),
                      on_token=lambda row, token, delta: pieces[row].append(delta))
    for row, seq in enumerate(result.sequences):
        assert "".join(pieces[row]) == seq.text


@pytest.mark.parametrize("prompts, new_tokens, message", [
    ([""], 4, "empty"), (["   "], 4, "empty"), ([], 4, "no prompts"),
    (["hello"], 0, "new_tokens"), (["hello"], -3, "new_tokens"),
    (["word " * 600], 4, "context"), (["hello"], 600, "context"),
])
def test_bad_requests_are_clear_errors(tiny_model, prompts, new_tokens, message):
    model, tok = tiny_model
    with pytest.raises(InputError, match=message) as err:
        generate(model, tok, prompts, new_tokens)
    assert err.value.fix


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_settings_are_clear_errors(kwargs, message):
    with pytest.raises(InputError, match=message):
        SamplingParams(**kwargs)


def test_probabilities_apply_top_k_and_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert probabilities(logits, SamplingParams())[0].tolist() == [1, 0, 0, 0, 0]
    topk = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    assert (topk[2:] == 0).all() and topk[:2].sum() == pytest.approx(1)
    full = logits.softmax(-1)[0]
    # top_p just above the first token's mass keeps exactly two tokens
    topp = probabilities(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))[0]
    assert (topp > 0).sum() == 2
    assert topp[0] / topp[1] == pytest.approx(float(full[0] / full[1]))


def test_cache_crop_then_append_equals_building_the_shorter_cache(tiny_model):
    model, tok = tiny_model
    ids = torch.tensor([tok(PROMPTS[4]).input_ids])
    n = ids.shape[1]
    with torch.inference_mode():
        cache = ContiguousKVCache.for_model(model, n + 4)
        model(ids, cache=cache, use_cache=True)
        cache.crop(n - 3)
        assert cache.length == n - 3
        tail = model(ids[:, n - 3:], cache=cache, use_cache=True).logits
        fresh = model(ids, use_cache=False).logits[:, n - 3:]
    assert torch.allclose(tail, fresh, atol=1e-5)
    with pytest.raises(ValueError):
        cache.crop(n + 1)


def test_cache_nbytes_counts_the_filled_part(tiny_model):
    model, tok = tiny_model
    config = model.config.get_text_config(decoder=True)
    cache = ContiguousKVCache.for_model(model, 64)
    with torch.inference_mode():
        model(torch.tensor([tok(PROMPTS[0]).input_ids]), cache=cache, use_cache=True)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert cache.nbytes == per_token * cache.length


@pytest.mark.parametrize("weights, compute", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                             (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rows", [1, 16])
def test_half_storage_linear_matches_fp32_math(weights, compute, rows):
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32).to(compute)
    layer.weight.data = layer.weight.data.to(weights)
    layer.__class__ = HalfStorageLinear
    ref = torch.nn.Linear(64, 32)
    ref.load_state_dict({k: v.float() for k, v in layer.state_dict().items()})
    x = torch.randn(rows, 64).to(compute)
    out = layer(x)
    assert out.dtype == compute
    assert torch.allclose(out.float(), ref(x.float()), atol=0.05, rtol=0.02)


def test_exact_linears_compute_beyond_fp16_range():
    layer = torch.nn.Linear(4, 2, bias=False)
    layer.weight.data = torch.ones(2, 4, dtype=torch.float16)
    layer.__class__ = HalfStorageLinear
    x = torch.full((1, 4), 30000.0)  # each product fits fp16, their sum (120000) does not
    assert torch.isinf(layer(x)).all()
    with exact_linears():
        assert layer(x).tolist() == [[120000.0, 120000.0]]
    assert torch.isinf(layer(x)).all()


def test_engine_redoes_an_overflowed_fp16_step_exactly(tiny_llama_dir, tiny_tokenizer):
    """Scale one MLP so its fp16 product overflows: the engine must notice, roll the cache back and rerun the step
    in fp32, giving the fp32 model's tokens."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        ref.model.layers[0].mlp.down_proj.weight.mul_(3000.0)
        ref.model.layers[0].mlp.up_proj.weight.mul_(30.0)
    import copy

    half = prepare_model(copy.deepcopy(ref), Precision(torch.float32, torch.float16))
    ids = torch.tensor([tiny_tokenizer(PROMPTS[0]).input_ids])
    with torch.inference_mode():
        assert not torch.isfinite(half(ids[:, :1]).logits).all()  # the raw fp16 path does overflow
    expected = generate(ref, tiny_tokenizer, [PROMPTS[0]], 8, stop_tokens=set()).sequences[0].token_ids
    assert generate(half, tiny_tokenizer, [PROMPTS[0]], 8, stop_tokens=set()).sequences[0].token_ids == expected


def test_argmax_is_torchs_argmax():
    """The engine's argmax (numpy's reduction for fp32 on the CPU) gives torch's answer: the first of tied maxima,
    the first NaN where there is one, any leading shape, strided views, other dtypes through torch."""
    from toolkit.engine.sampling import argmax

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 700, generator=g)
    logits[0, 0, [10, 20, 30]] = 50.0  # a tie: the first index wins
    logits[1, 2, [600, 40]] = float("nan")
    logits[2, 4, 699] = float("inf")
    for x in (logits, logits[1], logits[0, 0], logits[:, :, ::3], logits.transpose(0, 1), logits.bfloat16()):
        got = argmax(x)
        assert got.dtype == torch.int64 and got.shape == x.shape[:-1]
        assert torch.equal(got, x.argmax(-1))
    assert argmax(logits)[0, 0] == 10 and argmax(logits)[1, 2] == 40 and argmax(logits)[2, 4] == 699


def test_overflowed_sees_any_non_finite_logit():
    """The engine's overflow check (a sum, not a full isfinite): one inf, -inf or NaN anywhere is caught, finite
    logits pass, and a model whose path cannot overflow is never redone."""

    from toolkit.engine.precision import overflowed

    half, exact = torch.nn.Identity(), torch.nn.Identity()  # models the engine prepared: what overflowed reads
    state_of(half).precision = Precision(torch.float32, torch.float16)
    state_of(exact).precision = Precision(torch.float32, torch.float32)
    logits = torch.randn(2, 6, 1000) * 30
    assert not overflowed(half, logits)
    for bad in (float("inf"), float("-inf"), float("nan")):
        for where in ((0, 0, 0), (1, 5, 999), (1, 2, 500)):
            spoiled = logits.clone()
            spoiled[where] = bad
            assert overflowed(half, spoiled)
            assert not overflowed(exact, spoiled)


def test_auto_precision_follows_the_hardware(monkeypatch):
    from toolkit.engine import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto") == Precision(torch.float32, torch.float16)
    assert resolve_precision("fp32") == Precision(torch.float32, torch.float32)
    assert resolve_precision("auto", "bf16") == Precision(torch.float32, torch.bfloat16)
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    # native bf16 speeds prefill but not a decode step: auto stays fp32 + fp16 weights on every CPU
    assert resolve_precision("auto") == Precision(torch.float32, torch.float16)
    assert resolve_precision("auto", device="cuda") == Precision(torch.bfloat16, torch.bfloat16)
    assert resolve_precision("bf16") == Precision(torch.bfloat16, torch.bfloat16)
    with pytest.raises(InputError, match="engine.dtype"):
        resolve_precision("fp64")


@pytest.mark.parametrize("precision, min_agreement", [(Precision(torch.float32, torch.float16), 0.95),
                                                      (Precision(torch.bfloat16, torch.bfloat16), 0.85)])
def test_half_precision_engine_stays_close_to_fp32(tiny_model, precision, min_agreement):
    """Half-precision weights change logits slightly: teacher-forced top-1 choices mostly agree with fp32 (a random
    tiny model has many near-ties, so not all; greedy runs would diverge after the first flip)."""
    import copy

    model, tok = tiny_model
    half = prepare_model(copy.deepcopy(model), precision)
    ids = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.inference_mode():
        ref, out = model(**ids).logits, half(**ids).logits.float()
    real = ids.attention_mask.bool()
    agreement = (ref.argmax(-1) == out.argmax(-1))[real].float().mean()
    assert agreement >= min_agreement
    assert (ref - out)[real].abs().max() < 0.5
    assert generate(half, tok, PROMPTS[:2], 4).sequences[0].token_ids  # and the engine runs it


def test_prepare_model_keeps_tied_weights_tied(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = prepare_model(AutoModelForCausalLM.from_pretrained(tiny_llama_dir), Precision(torch.float32, torch.float16))
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.lm_head.weight.dtype == torch.float16
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float16
    assert model.model.norm.weight.dtype == torch.float32
    with torch.inference_mode():
        assert model.get_input_embeddings()(torch.tensor([[1, 2]])).dtype == torch.float32


def test_wide_copy_gives_the_same_logits_and_is_not_counted_as_weight_bytes(tiny_llama_dir):
    """The fp32 copy kept for multi-row products is the half weight upcast exactly: prefill logits are bitwise those
    of upcasting on every call, and the bytes a decode step reads do not include it."""
    import copy

    from transformers import AutoModelForCausalLM

    from toolkit.quant.qlinear import weight_bytes

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    plain = prepare_model(copy.deepcopy(ref), Precision(torch.float32, torch.float16), wide_copy=False)
    wide = prepare_model(copy.deepcopy(ref), Precision(torch.float32, torch.float16), wide_copy=True)
    copies = [m for m in wide.modules() if getattr(m, "wide_weight", None) is not None]
    assert copies and all(m.wide_weight.dtype == torch.float32 for m in copies)
    assert not any(getattr(m, "wide_weight", None) is not None for m in plain.modules())
    ids = torch.randint(0, ref.config.vocab_size, (2, 9))
    with torch.inference_mode():
        assert torch.equal(plain(ids).logits, wide(ids).logits)
    assert weight_bytes(wide) == weight_bytes(plain)


def test_fbgemm_fp16_path_matches_the_wide_path_and_generates_the_same_tokens(tiny_llama_dir, tiny_tokenizer):
    """engine.gemm=fbgemm multiplies the same fp16 weights in fp32 (in another summation order): logits within fp32
    rounding of the wide path's at few-row and many-row products, the same greedy tokens, and products of
    FBGEMM_MAX_ROWS rows or more take the wide path itself."""
    import copy

    from transformers import AutoModelForCausalLM

    from toolkit.engine import precision as P

    if not P.fbgemm_available():
        pytest.skip("this torch build has no fbgemm")
    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    half = Precision(torch.float32, torch.float16)
    wide = prepare_model(copy.deepcopy(ref), half, wide_copy=True, gemm="torch")
    fb = prepare_model(copy.deepcopy(ref), half, wide_copy=True, gemm="fbgemm")
    packed = [m for m in fb.modules() if getattr(m, "fbgemm_fp16", None) is not None]
    assert len(packed) == sum(isinstance(m, torch.nn.Linear) for m in fb.modules())
    with torch.inference_mode():
        for rows in (1, 5, 40):
            x = torch.randn(rows, 64)
            layer_fb, layer_wide = fb.model.layers[0].mlp.up_proj, wide.model.layers[0].mlp.up_proj
            with exact_linears():
                expected = layer_wide(x)
            torch.testing.assert_close(layer_fb(x), expected, rtol=1e-5, atol=1e-5)
        big = torch.randn(P.FBGEMM_MAX_ROWS, 64)
        assert torch.equal(fb.model.layers[0].mlp.up_proj(big), wide.model.layers[0].mlp.up_proj(big))
        ids = torch.randint(0, ref.config.vocab_size, (2, 9))
        torch.testing.assert_close(fb(ids).logits, wide(ids).logits, rtol=1e-4, atol=1e-4)
    prompts = ["Python's import system", "A class definition"]
    a = generate(wide, tiny_tokenizer, prompts, 12, stop_tokens=set())
    b = generate(fb, tiny_tokenizer, prompts, 12, stop_tokens=set())
    assert [s.token_ids for s in a.sequences] == [s.token_ids for s in b.sequences]
    with pytest.raises(Exception, match="engine.gemm"):
        prepare_model(copy.deepcopy(ref), half, gemm="blas")
