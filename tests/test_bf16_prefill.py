"""engine.prefill_dtype (toolkit/engine/precision.py): prompt passes of half-stored models in bf16, everything else
as before. What it resolves to, that its prompt products are bf16 and close to fp32, that decode steps and verify
passes keep their exact arithmetic, and that greedy speculation stays token-identical to the target alone."""

import contextlib

import pytest
import torch

from toolkit.engine import ContiguousKVCache, generate
from toolkit.engine.precision import (
    BF16_PREFILL_MIN_ROWS,
    HalfStorageLinear,
    Precision,
    bf16_prefill,
    prefill_runs_bf16,
    resolve_prefill,
)
from toolkit.errors import InputError

HALF = Precision(torch.float32, torch.float16)
CPU = torch.device("cpu")


def test_prefill_dtype_resolves_by_the_cpu_and_the_precision(monkeypatch):
    import toolkit.engine.precision as precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    assert resolve_prefill("auto", HALF, CPU) == "bf16"
    assert resolve_prefill("fp32", HALF, CPU) == "fp32"
    assert resolve_prefill("bf16", HALF, CPU) == "bf16"
    # nothing to do where the activations are not fp32 or the weights are not half-stored
    assert resolve_prefill("bf16", Precision(torch.bfloat16, torch.bfloat16), CPU) == "fp32"
    assert resolve_prefill("auto", Precision(torch.float32, torch.float32), CPU) == "fp32"
    assert resolve_prefill("auto", HALF, torch.device("cuda")) == "fp32"
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    assert resolve_prefill("auto", HALF, CPU) == "fp32"
    with pytest.raises(InputError, match="no native bf16") as err:
        resolve_prefill("bf16", HALF, CPU)
    assert "engine.prefill_dtype=auto or fp32" in err.value.fix
    with pytest.raises(InputError, match="unknown engine.prefill_dtype 'fp8'"):
        resolve_prefill("fp8", HALF, CPU)


def _engine(model_dir, prefill: str):
    from toolkit.engine.setup import default_engine_config, load_engine_model

    return load_engine_model(str(model_dir), default_engine_config(prefill_dtype=prefill))


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    """The tiny Llama prepared twice: exact prompts, and bf16 prompts (forced: on a CPU without native bf16 the
    products are slow, not wrong)."""
    import toolkit.engine.precision as precision

    native = precision.cpu_has_native_bf16
    precision.cpu_has_native_bf16 = lambda: True
    try:
        return _engine(tiny_llama_dir, "fp32"), _engine(tiny_llama_dir, "bf16")
    finally:
        precision.cpu_has_native_bf16 = native


def _prompt(tokenizer, n: int) -> torch.Tensor:
    import pydoc_data.topics

    ids = tokenizer(pydoc_data.topics.topics["class"]).input_ids[:n]
    assert len(ids) == n
    return torch.tensor([ids])


@contextlib.contextmanager
def _bf16_products():
    """The row counts of every product that ran in bf16 within the block."""
    rows, product = [], HalfStorageLinear.bf16_product

    def spy(self, x, n):
        y = product(self, x, n)
        if y is not None:
            rows.append(n)
        return y

    HalfStorageLinear.bf16_product = spy
    try:
        yield rows
    finally:
        HalfStorageLinear.bf16_product = product


def _pass(model, ids, cache, bf16: bool) -> torch.Tensor:
    with torch.inference_mode(), (bf16_prefill() if bf16 else contextlib.nullcontext()):
        return model(input_ids=ids, cache=cache, use_cache=True).logits


def test_a_bf16_prompt_pass_runs_bf16_products_close_to_fp32_and_nothing_else_changes(pair):
    exact, fast = pair[0].model, pair[1].model
    assert not prefill_runs_bf16(exact) and prefill_runs_bf16(fast)
    layers = [m for m in fast.modules() if hasattr(m, "bf16_weight")]
    assert layers and all(m.bf16_weight.dtype == torch.bfloat16 for m in layers)
    assert not hasattr(fast.get_output_embeddings(), "bf16_weight")  # a prompt pass keeps one row of logits
    assert not any(hasattr(m, "bf16_weight") for m in exact.modules())
    assert not any("bf16_weight" in k for k in fast.state_dict())  # a runtime copy, never saved
    ids = _prompt(pair[0].tokenizer, 40)
    new = lambda n: ContiguousKVCache.for_model(exact, n)  # noqa: E731
    reference = _pass(exact, ids, new(48), bf16=True)  # fp32-prepared: the context changes nothing
    assert torch.equal(reference, _pass(exact, ids, new(48), bf16=False))
    # outside the context the bf16-prepared model is the exact one, bit for bit: one sequence (the native stack
    # where it applies) and a batch (layer by layer)
    assert torch.equal(reference, _pass(fast, ids, new(48), bf16=False))
    batch = torch.cat([ids, ids.flip(1)])
    with _bf16_products() as bf16_rows:
        assert torch.equal(_pass(exact, batch, new(48), bf16=False), _pass(fast, batch, new(48), bf16=False))
    assert not bf16_rows
    with _bf16_products() as bf16_rows:
        prompt = _pass(fast, ids, new(48), bf16=True)
    # every layer's products ran in bf16 (q, k, v, o, gate, up, down; the head keeps fp16 storage's own path) ...
    assert len(bf16_rows) == 7 * fast.config.num_hidden_layers and set(bf16_rows) == {40}
    probs, ref_probs = prompt.softmax(-1), reference.softmax(-1)
    tv = 0.5 * (probs - ref_probs).abs().sum(-1)
    assert tv.max() < 0.05 and (prompt.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9  # ... close to fp32
    # fewer rows than BF16_PREFILL_MIN_ROWS, and every step after the prompt, keep the exact arithmetic
    short = ids[:, :BF16_PREFILL_MIN_ROWS - 1]
    assert torch.equal(_pass(fast, short, new(48), bf16=True), _pass(exact, short, new(48), bf16=False))
    caches = new(80), new(80)
    _pass(exact, ids, caches[0], bf16=False)
    _pass(exact, ids, caches[1], bf16=False)
    for step in ([[5]], [list(range(7, 7 + 2 * BF16_PREFILL_MIN_ROWS, 2))]):  # a decode step, a long verify pass
        step = torch.tensor(step)
        with _bf16_products() as bf16_rows:
            assert torch.equal(_pass(exact, step, caches[0], bf16=False), _pass(fast, step, caches[1], bf16=False))
        assert not bf16_rows


def test_generate_prefills_in_bf16_and_speculation_stays_identical_to_the_target_alone(pair):
    from toolkit.spec.build import build_draft
    from toolkit.spec.decode import DraftLength, speculative_generate
    from toolkit.spec.drafts import LookupDraft

    exact, fast = pair
    ids = _prompt(fast.tokenizer, 48)[0].tolist()
    prompts = [ids, ids[5:] + ids[:12]]
    with _bf16_products() as bf16_rows:
        alone = generate(fast.model, fast.tokenizer, prompts[:1], new_tokens=24)
    assert bf16_rows and set(bf16_rows) == {48}  # the prompt pass, and only it
    with _bf16_products() as bf16_rows:
        generate(exact.model, exact.tokenizer, prompts[:1], new_tokens=24)
        assert not bf16_rows
    with torch.inference_mode(), bf16_prefill():
        cache = ContiguousKVCache.for_model(fast.model, 60)
        first = fast.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
    assert alone.sequences[0].token_ids[0] == int(first.argmax())
    for draft in (LookupDraft(3, 1, scale_by_match=True, agree_tokens=4, doubt_k=2),
                  build_draft({"kind": "self", "bits": 4, "group_size": 32, "share_kv": True, "act_bits": 8,
                               "head_bits": 8, "head_group_size": 32}, fast.model, fast.tokenizer)):
        for prompt in prompts:
            target = generate(fast.model, fast.tokenizer, [prompt], new_tokens=24)
            spec = speculative_generate(fast.model, fast.tokenizer, [prompt], 24, draft, DraftLength(4))
            assert spec.sequences[0].token_ids == target.sequences[0].token_ids


def test_the_prefill_bench_times_both_copies_and_compares_their_outputs(tiny_llama_dir, monkeypatch, capsys):
    import toolkit.engine.precision as precision
    from benchmarks.prefill import print_result, run

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    out = run(str(tiny_llama_dir), [40], n_prompts=2, rounds=1, new_tokens=6)
    (row,) = out["rows"]
    assert row["prompts"] == 2 and 0 < row["prompt_tokens"] <= 40
    assert row["fp32_ms"] > 0 and row["bf16_ms"] > 0 and row["speedup"] == row["fp32_ms"] / row["bf16_ms"]
    # the two copies' prompt passes differ (bf16 ran) but barely; fp16 storage costs less than bf16 products
    assert 0 < row["kl"] < 0.05 and 0 <= row["kl_fp16_storage"] < row["kl"] and row["top1"] >= 0.5
    assert 0 <= row["same_continuations"] <= 2
    print_result(out)
    assert "same 6-token continuations" in capsys.readouterr().out
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    with pytest.raises(InputError, match="no native bf16"):  # the bench asks for bf16 by name: the engine refuses
        run(str(tiny_llama_dir), [40], n_prompts=1, rounds=1, new_tokens=2)


def test_a_quantized_checkpoints_long_prompt_dequantizes_to_bf16_and_its_steps_stay_exact(tiny_llama_dir,
                                                                                         tiny_tokenizer,
                                                                                         tmp_path, monkeypatch):
    """int4 layers keep their kernels below `kernel_max_rows`; a prompt pass past it dequantizes to bf16 (not fp32)
    where the checkpoint was loaded with bf16 prompt passes."""
    import toolkit.engine.precision as precision
    from transformers import AutoModelForCausalLM

    from toolkit.quant.checkpoint import save_quantized
    from toolkit.quant.model_quant import QuantRecipe, quantize_model
    from toolkit.quant.qlinear import QuantLinear

    llama = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    qsd = quantize_model(llama, QuantRecipe(bits=4, group_size=32, symmetric=False), progress=False)
    save_quantized(tmp_path / "q", llama, qsd, tokenizer=tiny_tokenizer, source="tiny-llama")
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
    exact, fast = (_engine(tmp_path / "q", p).model for p in ("fp32", "bf16"))
    layers = [m for m in fast.modules() if isinstance(m, QuantLinear)]
    assert layers and all(m.prefill_bf16 for m in layers)
    assert not any(m.prefill_bf16 for m in exact.modules() if isinstance(m, QuantLinear))
    rows = max(m.kernel_max_rows for m in layers) + 4
    ids = _prompt(tiny_tokenizer, rows)
    dtypes = []
    block = QuantLinear._weight_block

    def spy(self, n0, n1, dtype, fresh=False):
        dtypes.append(dtype)
        return block(self, n0, n1, dtype, fresh)

    monkeypatch.setattr(QuantLinear, "_weight_block", spy)
    new = lambda: ContiguousKVCache.for_model(exact, rows + 8)  # noqa: E731
    reference = _pass(exact, ids, new(), bf16=True)
    assert dtypes and set(dtypes) == {torch.float32}
    dtypes.clear()
    prompt = _pass(fast, ids, new(), bf16=True)
    assert dtypes and set(dtypes) == {torch.bfloat16}  # every dequantized block, in bf16
    tv = 0.5 * (prompt.softmax(-1) - reference.softmax(-1)).abs().sum(-1)
    assert 0 < tv.max() < 0.05
    assert torch.equal(_pass(fast, ids, new(), bf16=False), reference)  # outside a prompt pass: fp32 as before
    caches = new(), new()
    _pass(exact, ids[:, :-4], caches[0], bf16=False)
    _pass(exact, ids[:, :-4], caches[1], bf16=False)
    for step in (ids[:, -4:-3], ids[:, -3:]):  # a decode step, a verify pass: the kernels', identical
        assert torch.equal(_pass(exact, step, caches[0], bf16=True), _pass(fast, step, caches[1], bf16=True))


def test_int8_layers_keep_their_own_prompt_paths_in_a_bf16_prompt_pass():
    from toolkit.quant.primitives import QuantConfig, choose_qparams, quantize
    from toolkit.quant.qlinear import QuantLinear
    from toolkit.quant.quantized_weight import QuantizedWeight

    w = torch.randn(64, 128) * 0.05
    config = QuantConfig(bits=8, group_size=-1, symmetric=True)
    scale, zero = choose_qparams(w, config)
    layer = QuantLinear.from_quantized(QuantizedWeight(quantize(w, scale, zero, config), scale, zero, config))
    assert layer.kernel == "int8pack"
    for rows in (BF16_PREFILL_MIN_ROWS, 100, 300):
        x = torch.randn(rows, 128)
        layer.prefill_bf16 = False
        expected = layer(x)
        layer.prefill_bf16 = True
        with bf16_prefill():
            assert torch.equal(layer(x), expected), rows

