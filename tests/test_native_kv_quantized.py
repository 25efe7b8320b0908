"""The native stack over a KIVI cache (toolkit/engine/native_kv.py, attention.c `fill_chunk`): attention reads the
codes where they lie. Its logits are the torch path's within rounding (both read the same dequantized values; the
new keys differ by fp32 rounding, which can move a code), each row reads exactly what a one-token step reads (bit
for bit, across flushes and chunk boundaries), the cache's state stays a function of its length (crop, then
append), speculative greedy output is the target alone's, and the caches it does not read take the torch path."""

import copy

import pytest
import torch

from toolkit.engine.lean_forward import LeanForward, install
from toolkit.engine.native_decoder import library
from toolkit.engine.precision import Precision, prepare_model
from toolkit.kv import KVSpec, make_kv_cache
from toolkit.kv.config import KVQuantConfig
from toolkit.quant.qlinear import exact_prefill

pytestmark = pytest.mark.skipif(library() is None, reason="the native decoder is not built here (no C compiler, no "
                                                          "AVX2, or SPECQUANT_NO_KERNELS is set)")


@pytest.fixture(scope="module", params=["wide-fp16", "wide-int4", "qwen2-int8"])
def model(request, tiny_qwen2, tiny_wide_llama):
    """Head dim 64 with GQA (SmolLM2's attention shape) on fp16 and int4 products; the tiny Qwen2 (head dim 16,
    q,k,v biases) on int8 products."""
    from toolkit.spec.self_draft import build_self_draft

    arch, kind = request.param.split("-")
    target = copy.deepcopy(tiny_wide_llama if arch == "wide" else tiny_qwen2)
    prepare_model(target, Precision(torch.float32, torch.float16), gemm="fbgemm")
    install(target)
    out = target
    if kind == "int4":
        out = build_self_draft(target, bits=4, group_size=32)
    elif kind == "int8":
        out = build_self_draft(target, bits=8, group_size=-1)
    if out.forward.native_decoder() is None:
        pytest.skip(f"the native decoder does not run this model here: {out.forward.native_reason}")
    return out


def spec(bits: int, **options) -> KVSpec:
    """A quantized cache with a short window and small groups, so that a few hundred tokens flush many times."""
    kind = {8: "int8", 4: "int4", 2: "int2"}[bits]
    return KVSpec(kind, KVQuantConfig(bits=bits, **{"group_size": 16, "residual": 24, "rollback": 6, **options}))


CACHES = [spec(4), spec(8), spec(2, pre_rope=False, value_clip=True), spec(4, sink=0, group_size=64)]


def _ran_natively(model, monkeypatch) -> list:
    calls = []
    real = type(model.forward.native_decoder())._run_kivi

    def counting(self, *args):
        calls.append(args[0].shape[1])
        return real(self, *args)

    monkeypatch.setattr(type(model.forward.native_decoder()), "_run_kivi", counting)
    return calls


@pytest.mark.parametrize("kv", CACHES, ids=str)
def test_logits_over_the_codes_are_the_torch_paths_within_fp32_rounding(model, kv, monkeypatch):
    """A prompt (torch path), then single steps and passes past a chunk boundary (256): each call run natively on a
    copy of the cache the torch path holds at that point, so both read the same codes (the new keys differ by fp32
    rounding, which could move a code once quantized)."""
    calls = _ran_natively(model, monkeypatch)
    max_rows = model.forward.native_decoder().max_rows  # passes of more rows take the torch path
    torch.manual_seed(0)
    ids = torch.randint(4, model.config.vocab_size, (1, 300))
    torch_path = LeanForward(model, native=False)
    cache = make_kv_cache(model, 320, kv)
    worst = 0.0
    # exact_prefill: the torch path's int8 layers keep fp32 activations on many-row passes too (the stack does)
    with torch.inference_mode(), exact_prefill():
        torch_path(input_ids=ids[:, :40], cache=cache, use_cache=True)
        at = 40
        for n in (1, 1, 7, 1, 200, 1, 9, 1, 30, 1):
            before = len(calls)
            native = model(input_ids=ids[:, at:at + n], cache=copy.deepcopy(cache), use_cache=True).logits[0]
            reference = torch_path(input_ids=ids[:, at:at + n], cache=cache, use_cache=True).logits[0]
            assert (len(calls) > before) == (n < max_rows), n  # every call the stack takes ran on the codes
            if n < max_rows:
                assert not torch.equal(native, reference)  # the C stack really ran
            worst = max(worst, float((native - reference).abs().max() / reference.abs().max()))
            at += n
    assert calls.count(1) == 6
    assert worst <= 1e-4, worst


@pytest.mark.parametrize("kv", CACHES[:2], ids=str)
def test_a_verify_pass_reads_what_one_token_steps_read_bit_for_bit(model, kv):
    """With `stepwise_reads` (a speculative target's cache) a pass is cut where a flush falls inside it, and each row
    gets exactly the logits of one-token steps, past a chunk boundary too; a crop leaves the state a shorter cache
    holds, so the steps after it match as well."""
    _verify_passes_match_steps(model, kv)


def _verify_passes_match_steps(model, kv):
    torch.manual_seed(1)
    ids = torch.randint(4, model.config.vocab_size, (1, 300))
    cache = make_kv_cache(model, 320, kv)
    with torch.inference_mode():
        model(input_ids=ids[:, :60], cache=cache, use_cache=True)
        cache.stepwise_reads = True  # as speculative decoding sets it, once the prompt is in
        for start in range(60, 250, 38):
            model(input_ids=ids[:, start:start + 38], cache=cache, use_cache=True)
        for start, n in ((250, 6), (256, 5), (261, 4)):  # 250..265: across the boundary at 256 and flushes
            together = model(input_ids=ids[:, start:start + n], cache=cache, use_cache=True).logits[0]
            cache.crop(start)
            apart = torch.cat([model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits[0]
                               for i in range(start, start + n)])
            assert torch.equal(together, apart), (start, n)


def test_speculative_greedy_output_over_a_kivi_cache_is_the_target_alone(model, tiny_tokenizer, monkeypatch):
    _speculation_is_the_target_alone(model, tiny_tokenizer, monkeypatch)


def _speculation_is_the_target_alone(model, tiny_tokenizer, monkeypatch):
    import pydoc_data.topics

    from toolkit.engine import generate
    from toolkit.spec.decode import DraftLength, speculative_generate
    from toolkit.spec.drafts import LookupDraft

    calls = _ran_natively(model, monkeypatch)
    kv = spec(4, rollback=1)
    texts = [t for t in pydoc_data.topics.topics.values() if len(t) > 400]
    for i in range(3):
        prompt = texts[5 * i][:300] + " " + texts[5 * i][:60]
        alone = generate(model, tiny_tokenizer, [prompt], 40, stop_tokens=set(), kv=kv).sequences[0].token_ids
        out = speculative_generate(model, tiny_tokenizer, [prompt], 40, LookupDraft(3, 1),
                                   DraftLength(k=3 + i, adaptive=False), stop_tokens=set(), kv=kv)
        assert out.sequences[0].token_ids == alone, i
    assert calls and max(calls) > 1  # verify passes ran natively


@pytest.mark.parametrize("options", [dict(bits=2), dict(bits=8, hierarchical=True), dict(bits=4, dequant="torch")],
                         ids=["int2-pre-rope", "hierarchical", "dequant-torch"])
def test_caches_it_does_not_read_take_the_torch_path(model, options, monkeypatch):
    calls = _ran_natively(model, monkeypatch)
    kind = {8: "int8", 4: "int4", 2: "int2"}[options["bits"]]
    kv = KVSpec(kind, KVQuantConfig.from_node(options))
    ids = torch.randint(4, model.config.vocab_size, (1, 12))
    results = []
    for forward in (model.forward, LeanForward(model, native=False)):
        cache = make_kv_cache(model, 64, kv)
        with torch.inference_mode():
            forward(input_ids=ids[:, :8], cache=cache, use_cache=True)
            results.append(forward(input_ids=ids[:, 8:], cache=cache, use_cache=True).logits)
    assert torch.equal(*results) and not calls


@pytest.fixture(scope="module")
def int8_model(tiny_wide_llama):
    """The int4 stack on int8 activations (a draft's stack, a target's at engine.native_dot=int8), head dim 64 with
    GQA: the grouped keys' scores are taken in integers (attention.c `int_query`)."""
    from toolkit.engine.native_decoder import int_scores_built
    from toolkit.spec.self_draft import build_self_draft

    if not int_scores_built():
        pytest.skip("this build has no integer scores (they need AVX512-VNNI)")
    target = copy.deepcopy(tiny_wide_llama)
    prepare_model(target, Precision(torch.float32, torch.float16), gemm="fbgemm")
    install(target)
    out = build_self_draft(target, bits=4, group_size=32)
    out.forward.use_activations("int8")
    decoder = out.forward.native_decoder()
    if decoder is None or not decoder.int_scores:
        pytest.skip(f"the w4a8 stack does not run this model here: {out.forward.native_reason}")
    return out


def _steps(model, ids, cache, at: int, end: int) -> torch.Tensor:
    return torch.cat([model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits[0] for i in range(at, end)])


# groups of 16 (keys in integers, values in fp32), 32 (two value groups a row) and 64 (one), no sink
INTEGER_CACHES = [CACHES[0], spec(8, group_size=32), spec(4, group_size=32), CACHES[3]]


@pytest.fixture(scope="module")
def head_dim_128(tiny_tokenizer):
    """A 2-layer Llama with head dim 128 (Qwen2.5's), one key/value head for two query heads, on fp16 products."""
    from conftest import small_llama

    out = small_llama(tiny_tokenizer, heads=2, kv_heads=1, seed=4)
    prepare_model(out, Precision(torch.float32, torch.float16), gemm="fbgemm")
    install(out)
    if out.forward.native_decoder() is None:
        pytest.skip(f"the native decoder does not run this model here: {out.forward.native_reason}")
    return out


@pytest.mark.parametrize("kv", INTEGER_CACHES, ids=str)
def test_integer_scores_are_the_fp32_scores_within_int16_rounding(model, kv, monkeypatch):
    """The same prompt and steps with the grouped codes read in integers (forced on a stack with fp32 activations,
    whose logits follow the scores smoothly) and in fp32: close (the query and the weights rounded to int16), not
    equal (the integer path ran), past a chunk boundary (256)."""
    _integer_reads_close_to_fp32(model, kv, monkeypatch)


@pytest.mark.parametrize("kv", INTEGER_CACHES, ids=str)
def test_integer_scores_at_head_dim_128(head_dim_128, kv, monkeypatch):
    """The same at head dim 128: two registers of codes a row, four value groups of 32."""
    _integer_reads_close_to_fp32(head_dim_128, kv, monkeypatch)


def _integer_reads_close_to_fp32(model, kv, monkeypatch):
    from toolkit.engine.native_decoder import int_scores_built

    decoder = model.forward.native_decoder()
    if not int_scores_built() or decoder.dims.head_dim not in (64, 128):
        pytest.skip("integer scores need AVX512-VNNI and the register attention (head dim 64 or 128)")
    torch.manual_seed(2)
    ids = torch.randint(4, model.config.vocab_size, (1, 300))
    logits = {}
    with torch.inference_mode():
        for on in (True, False):
            monkeypatch.setattr(decoder, "int_scores", on)
            cache = make_kv_cache(model, 320, kv)
            model(input_ids=ids[:, :240], cache=cache, use_cache=True)
            logits[on] = _steps(model, ids, cache, 240, 270)
    diff = float((logits[True] - logits[False]).abs().max() / logits[False].abs().max())
    assert 0 < diff <= 1e-2, diff


@pytest.mark.parametrize("kv", INTEGER_CACHES, ids=str)
def test_a_calls_rows_do_not_depend_on_its_length_with_integer_scores(int8_model, kv):
    """A call of many rows (a prompt's: 60 queries a key/value head, which would read a chunk tile in fp32) takes the
    integer path too, so its first rows are a 10-row call's (20 queries, the register path) bit for bit."""
    torch.manual_seed(2)
    ids = torch.randint(4, int8_model.config.vocab_size, (1, 300))
    cache = make_kv_cache(int8_model, 320, kv)
    with torch.inference_mode():
        int8_model(input_ids=ids[:, :240], cache=cache, use_cache=True)
        together, first = (int8_model(input_ids=ids[:, 240:end], cache=copy.deepcopy(cache), use_cache=True).logits[0]
                           for end in (270, 250))
    assert torch.equal(together[:10], first)


@pytest.mark.parametrize("kv", INTEGER_CACHES[1:3], ids=str)
def test_a_verify_pass_reads_what_one_token_steps_read_with_integer_scores(int8_model, kv):
    _verify_passes_match_steps(int8_model, kv)


def test_speculative_greedy_output_with_integer_scores_is_the_target_alone(int8_model, tiny_tokenizer, monkeypatch):
    _speculation_is_the_target_alone(int8_model, tiny_tokenizer, monkeypatch)
