"""The lean forward (toolkit/engine/lean_forward.py): bit-identical logits to transformers' forward over the same
modules, for prefill, decode, multi-token passes on a filled cache and left-padded batches, with fp and quantized
KV caches and with fused fbgemm projections; the models it does not apply to keep transformers' forward; requests
it does not handle go to transformers; a self-draft copied from a lean target runs its own layers."""

import copy

import pytest
import torch

from toolkit.engine import ContiguousKVCache, generate
from toolkit.engine.fused_packs import fused_pack, set_fused_pack
from toolkit.engine.lean_forward import LeanForward, install
from toolkit.engine.precision import (
    FBGEMM_MAX_ROWS,
    Precision,
    fbgemm_available,
    prepare_model,
)
from toolkit.errors import InputError
from toolkit.model_state import peek


@pytest.fixture(params=["llama", "qwen2"])
def float_model(request, tiny_llama_dir, tiny_qwen2):
    from transformers import AutoModelForCausalLM

    if request.param == "qwen2":
        return copy.deepcopy(tiny_qwen2)
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def passes(model, forward, cache_factory):
    """Logits of a fixed script of calls: a left-padded 2-row prefill, three 1-token decode steps, one 5-token pass
    on the filled cache (a speculative verify), then one more step after cropping 3 of those 5 (a rollback)."""
    torch.manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(4, vocab, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0  # row 1 is left-padded
    cache = cache_factory(model)
    out = []

    def call(tokens, keep):
        nonlocal mask
        mask = torch.cat([mask, torch.ones(2, tokens.shape[1], dtype=torch.long)], dim=1) if out else mask
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -tokens.shape[1]:]
        with torch.inference_mode():
            out.append(forward(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache,
                               use_cache=True, logits_to_keep=keep).logits)

    call(ids, 1)
    for _ in range(3):
        call(torch.randint(4, vocab, (2, 1)), 1)
    call(torch.randint(4, vocab, (2, 5)), 0)
    cache.crop(cache.get_seq_length() - 3)
    mask = mask[:, :-3]
    call(torch.randint(4, vocab, (2, 1)), 1)
    return out


def assert_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape
        assert torch.equal(x, y), f"max difference {(x - y).abs().max().item()}"


def fp_cache(model):
    return ContiguousKVCache.for_model(model, 64)


def int4_cache(model):
    from toolkit.kv import KVSpec, make_kv_cache

    return make_kv_cache(model, 64, KVSpec("int4"))


@pytest.mark.parametrize("cache_factory", [fp_cache, int4_cache], ids=["fp-kv", "int4-kv"])
def test_lean_forward_is_bit_identical_to_transformers_in_fp32(float_model, cache_factory, monkeypatch):
    # the lean forward shares key/value heads in masked passes too (sdpa_gqa); transformers does when told to
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    expected = passes(float_model, float_model, cache_factory)
    assert install(float_model, "lean") == "lean"
    assert isinstance(float_model.forward, LeanForward)
    assert_identical(passes(float_model, float_model, cache_factory), expected)


def test_shared_key_value_heads_give_transformers_copied_heads_logits_within_rounding(float_model):
    """Left alone, transformers copies each key/value head for its query heads whenever a mask is given (a padded
    batch, a verify pass); the lean forward's sdpa_gqa shares them. The same sums, possibly blocked differently:
    within fp32 rounding, the same argmax."""
    expected = passes(float_model, float_model, fp_cache)
    assert install(float_model, "lean") == "lean"
    for x, y in zip(passes(float_model, float_model, fp_cache), expected, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        assert torch.equal(x.argmax(-1), y.argmax(-1))


@pytest.mark.skipif(not fbgemm_available(), reason="this torch build has no fbgemm")
def test_fused_fbgemm_projections_give_the_transformers_forwards_logits(float_model):
    """fp16 weights through fbgemm (the engine default on x86): one pack for q,k,v (with Qwen2's biases) and one for
    gate,up give the separate layers' logits within fp32 rounding (fbgemm may block a wider product's sum
    differently; on SmolLM2's shapes they came out bit-identical) and the same argmax; products of FBGEMM_MAX_ROWS
    rows or more take the separate layers' wide path, bit-identical to transformers' forward."""
    half = Precision(torch.float32, torch.float16)
    reference = prepare_model(copy.deepcopy(float_model), half, wide_copy=True, gemm="fbgemm")
    lean = prepare_model(copy.deepcopy(float_model), half, wide_copy=True, gemm="fbgemm")
    assert install(lean, "lean") == "lean"  # the torch operators (auto would run the native fp16 stack here)
    attn, mlp = lean.model.layers[0].self_attn, lean.model.layers[0].mlp
    assert fused_pack(attn, "qkv").sizes == (attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features)
    assert fused_pack(mlp, "gate_up").sizes == (mlp.gate_proj.out_features, mlp.up_proj.out_features)
    assert getattr(attn.q_proj, "fbgemm_fp16", None) is None  # the fused pack replaced it
    got, expected = passes(lean, lean, fp_cache), passes(reference, reference, fp_cache)
    for x, y in zip(got, expected, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
        assert torch.equal(x.argmax(-1), y.argmax(-1))
    ids = torch.randint(4, lean.config.vocab_size, (1, FBGEMM_MAX_ROWS))
    with torch.inference_mode():
        expected = reference(input_ids=ids, use_cache=False).logits
        assert torch.equal(lean(input_ids=ids, use_cache=False).logits, expected)


def test_engine_generate_gives_the_same_tokens_with_either_forward(tiny_llama_dir):
    from toolkit.engine.setup import default_engine_config, load_engine_model

    results = {}
    for choice in ("transformers", "lean"):
        cfg = default_engine_config(forward=choice)
        loaded = load_engine_model(str(tiny_llama_dir), cfg)
        assert peek(loaded.model).forward == choice
        out = generate(loaded.model, loaded.tokenizer, ["The syntax of", "A class is a"], new_tokens=12)
        results[choice] = [s.token_ids for s in out.sequences]
    assert results["lean"] == results["transformers"]


def test_models_it_does_not_apply_to_keep_transformers_forward(tiny_gemma3_dir):
    from transformers import AutoModelForCausalLM

    gemma = AutoModelForCausalLM.from_pretrained(tiny_gemma3_dir, dtype=torch.float32).eval()
    assert install(gemma) == "transformers"
    assert "forward" not in gemma.__dict__
    with pytest.raises(InputError, match="engine.forward=lean cannot run this model"):
        install(gemma, "lean")
    with pytest.raises(InputError, match="unknown engine.forward"):
        install(gemma, "fast")


def test_requests_the_lean_forward_does_not_handle_go_to_transformers(float_model):
    ids = torch.randint(4, float_model.config.vocab_size, (1, 6))
    with torch.inference_mode():
        expected = float_model(input_ids=ids, output_hidden_states=True)
        install(float_model)
        got = float_model(input_ids=ids, output_hidden_states=True)  # hidden states: transformers' forward
        assert got.hidden_states is not None and len(got.hidden_states) == len(expected.hidden_states)
        assert torch.equal(got.logits, expected.logits)
        no_cache = float_model(input_ids=ids, use_cache=False)  # the lean forward, without a cache
        assert torch.equal(no_cache.logits, expected.logits)
        float_model.set_attn_implementation("eager")
        try:  # another attention implementation: the lean loop calls it as transformers' layers would
            calls = []
            hook = float_model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
            eager = float_model(input_ids=ids, use_cache=False)
            hook.remove()
            assert not calls  # the lean forward never calls the attention module itself
            assert torch.equal(eager.logits, type(float_model).forward(float_model, input_ids=ids,
                                                                        use_cache=False).logits)
        finally:
            float_model.set_attn_implementation("sdpa")


def test_a_self_draft_of_a_lean_target_runs_its_own_layers(float_model):
    from toolkit.spec.self_draft import build_self_draft

    install(float_model)
    draft = build_self_draft(float_model, layers=1, bits=None)
    assert isinstance(draft.forward, LeanForward) and draft.forward.model is draft
    ids = torch.randint(4, float_model.config.vocab_size, (1, 6))
    with torch.inference_mode():
        lean = draft(input_ids=ids, use_cache=False).logits
        transformers = type(draft).forward(draft, input_ids=ids, use_cache=False).logits
        target = float_model(input_ids=ids, use_cache=False).logits
    assert torch.equal(lean, transformers)
    assert not torch.allclose(lean, target)


@torch.inference_mode()
def test_the_paged_servers_bucketed_attention_runs_under_the_lean_forward(tiny_llama_dir):
    """The server's paged cache hands its bucket plan from `cache.update` to the attention call through the kwargs
    dict transformers' layers pass; the lean loop passes it the same way: the plan is used, and the logits equal
    transformers' forward's over an identical cache."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from tests.test_paged_attention import LENGTHS, _prefilled, _step
    from toolkit.kv.paged import PagedKVCache
    from toolkit.kv.paged.attention import (
        PAGED_ATTENTION,
        PLAN_KEY,
        paged_sdpa,
        use_paged_attention,
    )

    models = {}
    for choice in ("transformers", "lean"):
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
        assert install(model, choice) == choice
        models[choice] = use_paged_attention(model)
    plans = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        plans.append(PLAN_KEY in kwargs)
        return paged_sdpa(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(PAGED_ATTENTION, spy)
    try:
        logits = {}
        for choice, model in models.items():
            cache = PagedKVCache(model, num_blocks=160, block_size=8, prefix_cache=False)
            seqs = _prefilled(model, cache, LENGTHS)
            tokens = [[11 + r + j for j in range(3)] for r in range(len(seqs))]
            plans.clear()
            logits[choice] = _step(model, cache, seqs, tokens, True)
            assert plans and all(plans), choice  # every layer's attention got the bucket plan
    finally:
        AttentionInterface.register(PAGED_ATTENTION, paged_sdpa)
    assert torch.equal(logits["lean"], logits["transformers"])


@pytest.mark.skipif(not fbgemm_available(), reason="this torch build has no fbgemm")
def test_a_quantized_self_draft_never_runs_the_targets_fused_fp16_packs(float_model):
    """The int4 self-draft deep-copies the target's layers and swaps their Linear layers for QuantLinear: the copies'
    fused fp16 packs are dropped (and a stale pack would be refused anyway) and replaced by int4 packs of the draft's
    own layers, so the draft runs its int4 weights, exactly as transformers' forward runs them."""
    from toolkit.engine.fused_packs import Int4N8Pack, Int4Pack
    from toolkit.quant.qlinear import QuantLinear
    from toolkit.spec.self_draft import build_self_draft

    target = prepare_model(float_model, Precision(torch.float32, torch.float16), wide_copy=True, gemm="fbgemm")
    install(target)
    draft = build_self_draft(target, bits=4, group_size=32)
    layer = draft.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert isinstance(attn.q_proj, QuantLinear)
    packs = {"int4pack": Int4Pack, "int4n8": Int4N8Pack}  # the int4 kernels' fused packs
    if attn.q_proj.kernel in packs:  # an int4 kernel runs the quantized layers: packed int4 too
        kind = packs[attn.q_proj.kernel]
        assert isinstance(fused_pack(attn, "qkv"), kind) and isinstance(fused_pack(mlp, "gate_up"), kind)
        assert fused_pack(attn, "qkv").sources == (attn.q_proj, attn.k_proj, attn.v_proj)
    else:
        assert fused_pack(attn, "qkv") is None and fused_pack(mlp, "gate_up") is None
    assert fused_pack(target.model.layers[0].self_attn, "qkv") is not None  # the target keeps its own
    assert not isinstance(fused_pack(target.model.layers[0].self_attn, "qkv"), (Int4Pack, Int4N8Pack))
    ids = torch.randint(4, target.config.vocab_size, (1, 6))
    with torch.inference_mode():
        lean = draft(input_ids=ids, use_cache=False).logits
        transformers = type(draft).forward(draft, input_ids=ids, use_cache=False).logits
        # a pack left on a swapped layer is stale: the lean forward runs the layer itself
        set_fused_pack(layer.self_attn, "qkv", fused_pack(target.model.layers[0].self_attn, "qkv"))
        stale = draft(input_ids=ids, use_cache=False).logits
    assert torch.equal(lean, transformers)
    assert torch.equal(stale, lean)


@pytest.mark.parametrize("native", [True, False], ids=["int4n8", "int4pack"])
def test_fused_int4_packs_give_the_quantized_layers_logits_bit_for_bit(float_model, monkeypatch, native):
    """QuantLinear layers on an int4 kernel (specquant's own, int4n8, or torch's, int4pack; a quantized checkpoint,
    an int4 self-draft): q,k,v and gate,up run as one int4 product each, bit-identical to the separate layers
    (prefill, decode, a 5-token pass, a crop); the layers keep their own packs for the dequantize path; act-order
    layers (a column permutation) are not fused."""
    from toolkit.engine.fused_packs import Int4N8Pack, Int4Pack, _fuse
    from toolkit.quant.qlinear import QuantLinear
    from toolkit.spec.self_draft import build_self_draft

    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")  # as in the bit-identity test above
    monkeypatch.setattr(QuantLinear, "native_kernels", native)
    target = copy.deepcopy(float_model)
    install(target)
    model = build_self_draft(target, bits=4, group_size=32)  # every decoder Linear an int4 QuantLinear
    attn = model.model.layers[0].self_attn
    kernel = "int4n8" if native else "int4pack"
    if attn.q_proj.kernel != kernel:
        pytest.skip(f"the {kernel} int4 kernel does not run these layers here")
    if not native and attn.q_proj._code_layout != "packed":  # torch's AVX512 layout: not known to stack along out
        assert fused_pack(attn, "qkv") is None
        pytest.skip("torch's int4 layout on this CPU is not the documented one: its layers are not fused")
    assert isinstance(fused_pack(attn, "qkv"), Int4N8Pack if native else Int4Pack)
    # the layers keep their own packs, for products of kernel_max_rows rows or more
    assert getattr(attn.q_proj, "weight_int4n8" if native else "weight_int4pack") is not None

    def transformers_forward(**kwargs):
        return type(model).forward(model, **kwargs)

    assert_identical(passes(model, model, fp_cache), passes(model, transformers_forward, fp_cache))
    attn.q_proj.register_buffer("g_idx", torch.arange(attn.q_proj.in_features, dtype=torch.int32))
    assert _fuse([attn.q_proj, attn.k_proj, attn.v_proj]) is None


def test_the_side_by_side_benchmark_runs_every_forward_on_the_same_tokens(tiny_llama_dir):
    from benchmarks.forward import FORWARDS, PASS_ROWS, _engine, print_result, run

    assert _engine(str(tiny_llama_dir), "lean-copied-kv", None).forward.share_kv_heads is False
    out = run(str(tiny_llama_dir), rounds=1, steps=2, threads=None)
    for rows in PASS_ROWS:
        assert all(out[f"{name}_{rows}_rows_ms"] > 0 for name in FORWARDS)
    assert out["max_abs_logit_difference"] < 1e-4  # fused packs: within fp32 rounding of the separate layers
    from toolkit.engine.precision import resolve_precision

    if fbgemm_available() and resolve_precision("auto") == Precision(torch.float32, torch.float16):
        assert set(out["fused"]) == {"q,k,v", "gate,up"}  # fbgemm packs: the default where bf16 is not native
    print_result(out)


@pytest.mark.skipif(not fbgemm_available(), reason="this torch build has no fbgemm")
def test_a_module_swapped_after_a_lean_pass_is_the_one_that_runs(float_model):
    """The lean forward looks each layer's modules up once and keeps that plan between calls. Swapping a module
    afterwards (a Linear, a whole layer's MLP projection pair) or giving a norm a new weight Parameter must reach the
    next pass: the logits then equal those of a lean forward made afresh over the swapped modules, bit for bit
    (and, with fused packs in play, transformers' forward within fp32 rounding)."""
    model = prepare_model(float_model, Precision(torch.float32, torch.float16), wide_copy=True, gemm="fbgemm")
    install(model, "lean")
    ids = torch.randint(4, model.config.vocab_size, (1, 6))
    with torch.inference_mode():
        before = model(input_ids=ids, use_cache=False).logits  # builds the plan
        plan = model.forward.plan()
        model(input_ids=ids, use_cache=False)
        assert model.forward.plan() is plan  # kept between calls while nothing is swapped
        layer = model.model.layers[0]
        swapped = torch.nn.Linear(layer.mlp.down_proj.in_features, layer.mlp.down_proj.out_features, bias=False)
        torch.nn.init.normal_(swapped.weight, std=0.5)
        layer.mlp.down_proj = swapped  # a plain fp32 Linear where an fbgemm-packed one was
        layer.self_attn.o_proj = copy.deepcopy(layer.self_attn.o_proj)  # same weights, new module: still right
        model.model.layers[-1].post_attention_layernorm.weight = torch.nn.Parameter(
            torch.linspace(0.5, 1.5, model.config.hidden_size))
        lean = model(input_ids=ids, use_cache=False).logits
        fresh = LeanForward(model)(input_ids=ids, use_cache=False).logits
        reference = type(model).forward(model, input_ids=ids, use_cache=False).logits
    assert not torch.equal(lean, before)
    assert torch.equal(lean, fresh)
    torch.testing.assert_close(lean, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("theta", [10000.0, 100000.0])  # SmolLM2's and Qwen2.5's rope_theta among them
def test_the_rotary_table_gives_the_modules_own_cos_and_sin_bit_for_bit(theta):
    """The lean forward reads cos, sin from a table the rotary module made once (`rotary_cos_sin`): every row equals
    what a call for that position returns, before and after the table grows, whatever the other positions in the
    call."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from toolkit.engine.lean_ops import rotary_cos_sin, rotary_table

    config = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=theta, max_position_embeddings=8192)
    rotary = LlamaRotaryEmbedding(config)
    hidden = torch.zeros(1, 1, 256)
    generator = torch.Generator().manual_seed(0)
    for positions in ([[0, 1, 2, 3, 4]], [[127]], torch.randint(0, 1024, (1, 9), generator=generator).tolist(),
                      [[1023, 1024, 1025]], torch.randint(0, 5000, (2, 7), generator=generator).tolist()):
        position_ids = torch.tensor(positions)
        cos, sin = rotary_cos_sin(rotary, hidden, position_ids)
        want_cos, want_sin = rotary(hidden, position_ids=position_ids)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        for row in range(position_ids.shape[0]):  # and one position at a time, as a decode step asks
            for j, p in enumerate(positions[row]):
                one_cos, one_sin = rotary(hidden, position_ids=torch.tensor([[p]]))
                assert torch.equal(cos[row, j], one_cos[0, 0]) and torch.equal(sin[row, j], one_sin[0, 0])
    assert rotary_table(rotary, hidden, 1)[0].shape[0] == 8192  # grown by doubling past 4999
    negative = torch.tensor([[-1, 0, 1]])  # not a row of the table: the module's own values
    assert all(torch.equal(a, b) for a, b in zip(rotary_cos_sin(rotary, hidden, negative),
                                                  rotary(hidden, position_ids=negative)))
