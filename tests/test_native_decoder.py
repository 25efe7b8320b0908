"""The native int4 decoder (toolkit/engine/native_decoder.py): an int4 Llama / Qwen2 stack in one C call gives the
lean forward's logits within fp32 rounding (a float model's stack on bf16 products, engine.native_dot=bf16: within
bf16 rounding); a row's logits do not depend on the rows fed beside it (bit for bit), so
speculative greedy output with a native target is the target alone's; calls it cannot run (batches, quantized KV
caches it does not read, bf16) take the torch path; `engine.forward=native` on a model it cannot run is a clear error."""

import copy

import pytest
import torch

from toolkit.engine import ContiguousKVCache, generate
from toolkit.engine.fused_packs import fused_pack, set_fused_pack
from toolkit.engine.lean_forward import LeanForward, install
from toolkit.engine.native_decoder import NativeDecoder, library
from toolkit.engine.precision import Precision, prepare_model
from toolkit.errors import InputError
from toolkit.quant import bf16_native, vnni

pytestmark = pytest.mark.skipif(library() is None, reason="the native decoder is not built here (no C compiler, no "
                                                          "AVX2, or SPECQUANT_NO_KERNELS is set)")


def _act_order(model, group: int):
    """`model` with each int4 QuantLinear re-quantized as act-order GPTQ leaves it: its columns quantized in a
    scattered order (one order per input width, as one Hessian gives q,k,v and gate,up one order), a g_idx saying
    each channel's group; then the fused packs made again."""
    from toolkit.engine.fused_packs import fuse_projections
    from toolkit.quant.primitives import QuantConfig, choose_qparams, quantize
    from toolkit.quant.qlinear import QuantLinear
    from toolkit.quant.quantized_weight import QuantizedWeight

    config, orders = QuantConfig(bits=4, group_size=group, symmetric=False), {}
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is QuantLinear:
                w = child.dequantized_weight()
                seed = torch.Generator().manual_seed(w.shape[1])
                perm = orders.setdefault(w.shape[1], torch.randperm(w.shape[1], generator=seed))
                scale, zero = choose_qparams(w[:, perm], config)
                position = torch.argsort(perm)
                codes = quantize(w[:, perm], scale, zero, config)[:, position]
                qw = QuantizedWeight(codes, scale, zero, config, child.bias, (position // group).to(torch.int32))
                setattr(module, name, QuantLinear.from_quantized(qw))
    for layer in model.model.layers:
        set_fused_pack(layer.self_attn, "qkv", None)
        set_fused_pack(layer.mlp, "gate_up", None)
    fuse_projections(model)
    return model


@pytest.fixture(params=["llama-int4", "qwen2-int4", "llama-fp16", "qwen2-fp16", "wide-fp16", "wide-int4", "llama-int8",
                        "wide-int8", "llama-int4ao", "wide-int4ao", "llama-bf16", "qwen2-bf16", "wide-bf16"])
def native_model(request, tiny_llama_dir, tiny_qwen2, tiny_tokenizer):
    """int4: every decoder Linear an int4 QuantLinear on specquant's kernel (the int4 self-draft of an engine-prepared
    fp32 model: fp16 output head on fbgemm, whose products are row-independent too), under the lean forward. fp16: the
    engine-prepared float model itself (fp16 weights, fp32 activations: the engine default), whose fp16 products the
    stack runs on specquant's fp16 kernel. bf16: the same float model with its stack's products and head on the bf16
    dot-product kernel (engine.native_dot=bf16)."""
    from transformers import AutoModelForCausalLM

    from toolkit.spec.self_draft import build_self_draft

    arch, kind = request.param.split("-")
    if arch == "qwen2":
        target = copy.deepcopy(tiny_qwen2)
    elif arch == "wide":  # head dim 64, SmolLM2's: the stack's attention in registers (attend_zmm)
        target = copy.deepcopy(request.getfixturevalue("tiny_wide_llama"))
    else:
        target = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prepare_model(target, Precision(torch.float32, torch.float16), gemm="fbgemm")
    install(target)
    if kind in ("int4", "int4ao"):
        model = build_self_draft(target, bits=4, group_size=32)
        if kind == "int4ao":  # act-order codes: every product gathers its inputs (QuantLinear.in_perm)
            model = _act_order(model, 32)
            layer = model.model.layers[0]
            assert fused_pack(layer.self_attn, "qkv").in_perm is not None and layer.mlp.down_proj.in_perm is not None
    elif kind == "int8":  # int8 per-channel symmetric: specquant's int8 GEMM (an int8 checkpoint's layers)
        model = build_self_draft(target, bits=8, group_size=-1)
    elif kind == "bf16":
        if not bf16_native.available():
            pytest.skip("bf16 products need the bf16 kernel (AVX512-BF16)")
        model = target
        model.forward.use_dot("bf16")
        native = model.forward.native_decoder()
        assert native is not None and native.head_kernel is bf16_native
        assert native.half == 4 * model.config.num_hidden_layers
    else:
        model = target
    if model.forward.native_decoder() is None:
        pytest.skip(f"the native decoder does not run this model here: {model.forward.native_reason}")
    model.specquant_test_kind = kind
    return model


STORES = [None, torch.float16]  # the cache's dtype: the activations' (fp32), fp16 (kv.dtype=auto on the stack)


def script(forward, model, batch: int = 1, store=None):
    """Logits of: a 9-token prompt (the torch path fills the cache), three decode steps, a 5-token pass on the filled
    cache (a speculative verify), a crop of 3 of those, one more step."""
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    cache = ContiguousKVCache.for_model(model, 64, store)
    out = []
    with torch.inference_mode():
        def call(n):
            out.append(forward(input_ids=torch.randint(4, vocab, (batch, n)), cache=cache, use_cache=True).logits)

        call(9)
        for _ in range(3):
            call(1)
        call(5)
        cache.crop(cache.get_seq_length() - 3)
        call(1)
    return out


@pytest.mark.parametrize("store", STORES)
def test_native_logits_are_the_lean_forwards_within_fp32_rounding(native_model, store):
    """Also over an fp16 cache: both paths read the same rounded keys and values (a key rounds the other way only
    where the two paths' fp32 sums straddle a rounding boundary, hence the wider bound)."""
    native = script(native_model.forward, native_model, store=store)
    torch_ops = script(LeanForward(native_model, native=False), native_model, store=store)
    if native_model.specquant_test_kind in ("int4", "int4ao"):
        assert torch.equal(native[0], torch_ops[0])  # the prompt fills an empty cache through the torch path
    else:
        assert native_model.forward.native_decoder().runs_prompts  # fp16, bf16, int8: the C stack runs it too
    first = 1 if native_model.specquant_test_kind in ("int4", "int4ao") else 0
    if native_model.specquant_test_kind == "bf16":  # bf16 rounding of every product's inputs: close, not equal
        for a, b in zip(native, torch_ops):
            assert not torch.equal(a, b)
            assert (a - b).abs().max() <= 0.03 * b.abs().max(), (a - b).abs().max() / b.abs().max()
        return
    bound = 1e-4 if store is None else 2e-3
    for a, b in zip(native[first:], torch_ops[first:]):
        assert (a - b).abs().max() <= bound * b.abs().max(), (a - b).abs().max()
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert not all(torch.equal(a, b) for a, b in zip(native[1:], torch_ops[1:]))  # the C stack really ran


@pytest.mark.parametrize("store", STORES)
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(native_model, store):
    """A 5-row pass gives each row exactly what five 1-row steps give (what speculative verification needs)."""
    torch.manual_seed(0)
    ids = torch.randint(4, native_model.config.vocab_size, (1, 20))
    cache = ContiguousKVCache.for_model(native_model, 64, store)
    with torch.inference_mode():
        native_model(input_ids=ids[:, :12], cache=cache, use_cache=True)
        together = native_model(input_ids=ids[:, 12:17], cache=cache, use_cache=True).logits[0]
        cache.crop(12)
        apart = torch.cat([native_model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits[0]
                           for i in range(12, 17)])
    assert torch.equal(together, apart)


@pytest.mark.parametrize("store", STORES)
def test_attention_split_along_the_tokens_keeps_rows_independent_and_matches_torch(native_model, store):
    """Past 256 tokens the stack's attention runs in chunks of keys, merged per row (decoder_layers.c,
    SQ_KV_CHUNK): a pass whose rows straddle a chunk boundary gives each row exactly what one-row steps give, and
    the logits at ~500 tokens of context stay the torch path's within rounding."""
    from toolkit.quant.qlinear import exact_prefill

    torch.manual_seed(1)
    ids = torch.randint(4, native_model.config.vocab_size, (1, 500))
    logits = {}
    for name, forward in (("native", native_model.forward), ("torch", LeanForward(native_model, native=False))):
        cache = ContiguousKVCache.for_model(native_model, 512, store)
        # exact_prefill: the torch path's int8 layers keep fp32 activations on many-row pieces too (the stack does)
        with torch.inference_mode(), exact_prefill():
            for start in range(0, 250, 50):  # prompts in pieces: the stack runs each (or the torch path does)
                forward(input_ids=ids[:, start:start + 50], cache=cache, use_cache=True)
            together = forward(input_ids=ids[:, 250:259], cache=cache, use_cache=True).logits[0]
            if name == "native":
                cache.crop(250)
                apart = torch.cat([forward(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits[0]
                                   for i in range(250, 259)])
                assert torch.equal(together, apart)
            for start in range(259, 490, 77):
                forward(input_ids=ids[:, start:start + 77], cache=cache, use_cache=True)
            logits[name] = forward(input_ids=ids[:, 490:491], cache=cache, use_cache=True).logits[0]
    if native_model.specquant_test_kind == "bf16":
        return  # its products round to bf16: the comparison above (rows) is the one that holds exactly
    bound = 1e-4 if store is None else 2e-3
    a, b = logits["native"], logits["torch"]
    assert (a - b).abs().max() <= bound * b.abs().max(), (a - b).abs().max() / b.abs().max()


def test_one_token_is_the_general_call_bit_for_bit(native_model, monkeypatch):
    """`LeanForward.one_token` (a drafted token's step without the call's tensors around it) gives the logits and
    the cache contents of the general call, bit for bit, and so do RaggedBatch's one-token feed and the engine's
    decode step, which take it;
    where the stack cannot run the call (a quantized cache it does not read, a token past the embedding) it answers
    None."""
    from toolkit.kv import KVSpec, make_kv_cache
    from toolkit.spec.ragged import RaggedBatch

    torch.manual_seed(0)
    ids = torch.randint(4, native_model.config.vocab_size, (1, 14)).tolist()[0]
    import importlib

    from toolkit.engine.generate import decode_step

    generate_module = importlib.import_module("toolkit.engine.generate")
    lean = native_model.forward
    caches = [ContiguousKVCache.for_model(native_model, 64) for _ in range(4)]
    ragged = RaggedBatch(native_model, caches[2], 1, 0)
    with torch.inference_mode():
        for cache in caches[:2] + caches[3:]:
            native_model(input_ids=torch.tensor([ids[:9]]), cache=cache, use_cache=True)
        ragged.feed([ids[:9]], logits=1)
        ragged.keep([9])
        for position, token in enumerate(ids[9:], start=9):
            general = native_model(input_ids=torch.tensor([[token]]), cache=caches[0], use_cache=True).logits
            assert torch.equal(lean.one_token(token, position, caches[1]), general)
            assert torch.equal(ragged.feed([[token]], logits=1), general)
            # the engine's decode step (generate) takes it too, never its general call
            with monkeypatch.context() as patch:
                patch.setattr(generate_module, "_forward", None)
                stepped = decode_step(native_model, torch.tensor([[token]]), None, torch.tensor([[position]]), caches[3])
            assert torch.equal(stepped, general[:, -1])
        assert ragged.counts.tolist() == [14]
        quantized = make_kv_cache(native_model, 64, KVSpec("int2"))  # keys quantized before rotation
        native_model(input_ids=torch.tensor([ids[:9]]), cache=quantized, use_cache=True)
        assert lean.one_token(ids[9], 9, quantized) is None
        assert lean.one_token(native_model.config.vocab_size + 5, 14, caches[1]) is None
    for a, *others in zip(*(cache.layers for cache in caches)):
        assert a.length == 14
        assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for b in others)


def test_calls_it_cannot_run_take_the_torch_path(native_model):
    """A batch of two, a quantized KV cache it does not read (keys quantized before rotation: int2's default; the
    caches it reads: tests/test_native_kv_quantized.py): the lean forward's torch operators, bit for bit."""
    from toolkit.kv import KVSpec, make_kv_cache

    torch_path = LeanForward(native_model, native=False)
    assert all(torch.equal(a, b) for a, b in zip(script(native_model.forward, native_model, batch=2),
                                                   script(torch_path, native_model, batch=2)))
    ids = torch.randint(4, native_model.config.vocab_size, (1, 12))
    results = []
    for forward in (native_model.forward, torch_path):
        cache = make_kv_cache(native_model, 64, KVSpec("int2"))
        with torch.inference_mode():
            forward(input_ids=ids[:, :8], cache=cache, use_cache=True)
            results.append(forward(input_ids=ids[:, 8:], cache=cache, use_cache=True).logits)
    assert torch.equal(*results)


@pytest.mark.parametrize("store", STORES)
def test_the_kv_cache_holds_what_the_torch_path_would_have_written(native_model, store):
    torch.manual_seed(0)
    ids = torch.randint(4, native_model.config.vocab_size, (1, 14))
    caches = []
    for forward in (native_model.forward, LeanForward(native_model, native=False)):
        cache = ContiguousKVCache.for_model(native_model, 64, store)
        with torch.inference_mode():
            forward(input_ids=ids[:, :9], cache=cache, use_cache=True)
            forward(input_ids=ids[:, 9:], cache=cache, use_cache=True)
        caches.append(cache)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.length == b.length == 14
        if native_model.specquant_test_kind == "bf16":  # bf16 rounding: within 2% of the largest
            assert not torch.equal(a.keys, b.keys)
            assert (a.keys - b.keys).abs().max() <= 0.02 * b.keys.abs().max()
            assert (a.values - b.values).abs().max() <= 0.02 * b.values.abs().max()
        elif store is None:
            assert torch.allclose(a.keys, b.keys, atol=1e-4) and torch.allclose(a.values, b.values, atol=1e-4)
        else:  # rounded by the kernel's vcvtps2ph and by torch's .half(): the same, but where fp32 sums straddle
            assert a.keys.dtype == b.keys.dtype == store
            assert torch.allclose(a.keys.float(), b.keys.float(), rtol=2e-3, atol=1e-4)
            assert torch.allclose(a.values.float(), b.values.float(), rtol=2e-3, atol=1e-4)


@pytest.mark.skipif(not vnni.available(), reason="int8 activations need the int8 kernel (AVX2)")
def test_int8_activations_approximate_the_fp32_stack_and_keep_rows_independent(native_model):
    """(int4 and int8 stacks: fp16 products keep fp32 activations.) A draft's stack (spec.act_bits=8) or
    engine.native_dot=int8: every product on the w4a8 (w8a8) kernel, close to the fp32 stack but not it, the
    prompt included (an empty cache is filled by the C stack too, keys and values close to the torch path's), and a
    row's logits still do not depend on the rows beside it."""
    if native_model.specquant_test_kind not in ("int4", "int4ao", "int8"):
        pytest.skip("int8 activations are for int4 and int8 products")
    if native_model.specquant_test_kind == "int8" and not vnni.available(bits=8):
        pytest.skip("int8 weights x int8 activations need AVX512-VNNI")
    exact = script(native_model.forward, native_model)
    native_model.forward.use_activations("int8")
    native = native_model.forward.native_decoder()
    assert native is not None and native.w4a8 == 4 * native_model.config.num_hidden_layers and native.runs_prompts
    approx = script(native_model.forward, native_model)
    for a, b in zip(approx, exact):  # 10%: the prompt's keys and values are approximate too, and errors compound
        assert not torch.equal(a, b)
        assert (a - b).abs().max() <= 0.1 * b.abs().max(), (a - b).abs().max() / b.abs().max()
    ids = torch.randint(4, native_model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    caches = [ContiguousKVCache.for_model(native_model, 64) for _ in range(2)]
    with torch.inference_mode():
        native_model(input_ids=ids, cache=caches[0], use_cache=True)  # 40 rows: above the fp32 packs' own limit too
        LeanForward(native_model, native=False)(input_ids=ids, cache=caches[1], use_cache=True)
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert a.length == b.length == 40 and not torch.equal(a.keys, b.keys)
        assert (a.keys - b.keys).abs().max() <= 0.05 * b.keys.abs().max()
        assert (a.values - b.values).abs().max() <= 0.05 * b.values.abs().max()
    for store in STORES:
        test_a_rows_logits_do_not_depend_on_the_rows_beside_it(native_model, store)
    with pytest.raises(ValueError, match="activations"):
        native_model.forward.use_activations("int4")


@pytest.mark.parametrize("draft_kind", ["lookup", "self-int4", "self-w4a8-shared-kv"])
def test_speculative_greedy_output_with_a_native_target_is_the_target_alone(native_model, tiny_tokenizer, draft_kind):
    import pydoc_data.topics

    from toolkit.spec.build import build_draft
    from toolkit.spec.decode import DraftLength, speculative_generate
    from toolkit.spec.drafts import LookupDraft, ModelDraft
    from toolkit.spec.ragged import RaggedBatch
    from toolkit.spec.self_draft import build_self_draft

    texts = [t for t in pydoc_data.topics.topics.values() if len(t) > 400]
    prompts = [texts[3 * i][:50 + 9 * i] + " " + texts[3 * i][:20] for i in range(6)]
    # one prompt at a time, as the speculative runs: an int8 layer's prompt path depends on the rows of the whole
    # batch (its exact kernel below INT8_NATIVE_MAX_ROWS rows, int8 x int8 from there), so a batched prefill can differ
    reference = [generate(native_model, tiny_tokenizer, [p], 20, stop_tokens=set()).sequences[0].token_ids
                 for p in prompts]
    widths = []
    feed = RaggedBatch.feed
    for i, prompt in enumerate(prompts):
        if draft_kind == "lookup":
            draft = LookupDraft(3, 1)
        elif draft_kind == "self-int4":
            draft = ModelDraft(build_self_draft(native_model, layers=1, bits=4, group_size=32))
        else:  # the spec=self defaults on a VNNI CPU: int8 activations, w8a8 head, the target's keys and values
            draft = build_draft({"kind": "self", "bits": 4, "group_size": 32, "share_kv": True, "act_bits": 8,
                                 "head_bits": 8, "head_group_size": 32}, native_model, tiny_tokenizer)
            assert isinstance(draft.model.lm_head, vnni.VnniLinear) == vnni.available(8)
        length = DraftLength(k=2 + i % 4, adaptive=i % 2 == 1, k_min=1, k_max=6)

        def recording(self, rows, logits=None):
            if self.model is getattr(draft, "model", None):
                widths.append(max(len(r) for r in rows))
            return feed(self, rows, logits)

        RaggedBatch.feed = recording
        try:
            out = speculative_generate(native_model, tiny_tokenizer, [prompt], 20, draft, length, stop_tokens=set())
        finally:
            RaggedBatch.feed = feed
        assert out.sequences[0].token_ids == reference[i], i
        if draft_kind == "self-w4a8-shared-kv":
            assert draft.target is not None and draft.model.forward.native_decoder().w4a8 == vnni.available() * 8
            assert out.stats.accepted > 0
    if draft_kind == "self-w4a8-shared-kv":
        assert max(widths) == 1  # the draft never ran a prompt: it reads the target's keys and values


def test_native_forward_on_a_model_it_cannot_run_is_a_clear_error(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with pytest.raises(InputError, match="engine.forward=native cannot run this model: no fused q,k,v"):
        install(model, "native")  # fp32 layers, not prepared by the engine: no packs at all
    assert install(model, "auto") == "lean"  # float layers: the lean forward's torch path


def test_the_native_view_follows_a_swapped_layer(native_model):
    """A layer swapped after install (a float Linear in place of an int4 one) turns the native decoder off."""
    assert isinstance(native_model.forward.native_decoder(), NativeDecoder)
    layer = native_model.model.layers[0].mlp
    down = layer.down_proj
    layer.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False)
    try:
        assert native_model.forward.native_decoder() is None
        assert "not every" in native_model.forward.native_reason
    finally:
        layer.down_proj = down
    assert native_model.forward.native_decoder() is not None
