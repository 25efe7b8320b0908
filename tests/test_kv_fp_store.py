"""The float KV cache in 2 bytes (kv.dtype, docs/kv-cache.md "The float cache in 2 bytes"): what `auto` picks,
what an explicit dtype forces, reading a narrower store widened, and greedy speculative output still identical to the
target alone over an fp16 cache the native stack reads in place."""

import pytest
import torch

from toolkit.engine.generate import generate
from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError
from toolkit.kv import KVSpec, make_kv_cache
from toolkit.kv.contiguous import ContiguousKVLayer
from toolkit.model_state import peek


def test_kv_dtype_is_read_checked_and_named():
    assert KVSpec.from_node({"kind": "fp"}).dtype == "auto" and str(KVSpec.from_node({"kind": "fp"})) == "fp"
    spec = KVSpec.from_node({"kind": "fp", "dtype": "fp16"})
    assert spec.dtype == "fp16" and str(spec) == "fp fp16"
    with pytest.raises(InputError, match="kv.dtype"):
        KVSpec.from_node({"kind": "fp", "dtype": "half"})
    with pytest.raises(InputError, match="kv.dtype=fp16 is for kv=fp"):
        KVSpec.from_node({"kind": "int8", "dtype": "fp16"})
    assert KVSpec.from_node({"kind": "int8"}).with_rollback(5, "x").quant.rollback == 5


def test_a_narrower_store_is_written_rounded_and_read_widened():
    layer = ContiguousKVLayer(8, torch.float16)
    keys, values = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    k, v = layer.update(keys, values)
    assert layer.key_buffer.dtype == torch.float16 and k.dtype == v.dtype == torch.float32
    assert torch.equal(k, keys.half().float()) and torch.equal(v, values.half().float())
    assert layer.nbytes == 2 * 2 * 3 * 8 * 2
    # kv.dtype=auto's rule: a batch runs torch's attention, which would widen a copy every step: activations' dtype
    batch = ContiguousKVLayer(8, torch.float16, one_sequence=True)
    batch.update(torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8))
    assert batch.key_buffer.dtype == torch.float32


@pytest.fixture(scope="module")
def engine_model(tiny_llama_dir):
    loaded = load_engine_model(str(tiny_llama_dir), EngineSpec())
    return loaded.model, loaded.tokenizer


def _store(model, kv, batch=1):
    cache = make_kv_cache(model, 32, kv)
    with torch.inference_mode():
        model(input_ids=torch.full((batch, 4), 7), cache=cache, use_cache=True)
    return cache.layers[0].key_buffer.dtype


def test_auto_is_fp16_for_one_sequence_on_the_native_stack_and_explicit_dtypes_hold(engine_model):
    from toolkit import cpu

    model, _ = engine_model
    if peek(model).forward != "native":
        pytest.skip("the native stack does not run here")
    # AVX512 widens fp16 in registers; on AVX2 the tile it widens into first costs more than the bytes saved
    assert _store(model, KVSpec()) == (torch.float16 if cpu.isa() in ("avx512", "amx") else torch.float32)
    assert _store(model, KVSpec(), batch=2) == torch.float32
    assert _store(model, KVSpec(dtype="fp32")) == torch.float32
    assert _store(model, KVSpec(dtype="bf16"), batch=2) == torch.bfloat16  # torch's attention reads it widened


def test_speculative_output_over_an_fp16_cache_is_the_target_alone(engine_model):
    import pydoc_data.topics

    from toolkit.spec.decode import DraftLength, speculative_generate
    from toolkit.spec.drafts import LookupDraft

    model, tokenizer = engine_model
    text = pydoc_data.topics.topics["assignment"][:300]
    for kv in (KVSpec(), KVSpec(dtype="fp16"), KVSpec(dtype="bf16")):
        alone = generate(model, tokenizer, [text + " " + text[:40]], 24, stop_tokens=set(), kv=kv)
        spec = speculative_generate(model, tokenizer, [text + " " + text[:40]], 24, LookupDraft(3, 1),
                                    DraftLength(k=4), stop_tokens=set(), kv=kv)
        assert spec.sequences[0].token_ids == alone.sequences[0].token_ids, kv
        assert spec.stats.accepted > 0


def test_a_narrower_float_cache_is_a_configuration_of_its_own_in_the_report():
    from toolkit.report.rows import config_key

    bench = {"kind": "bench", "config": {"model": {"name": "m"}, "kv": {"kind": "fp", "dtype": "fp16"},
                                         "spec": {"kind": "none"}}}
    evaluation = {"kind": "eval", "kv": "fp fp16", "config": {"model": {"name": "m"},
                                                             "kv": {"kind": "fp", "dtype": "fp16"}}}
    default = {"kind": "bench", "config": {"model": {"name": "m"}, "kv": {"kind": "fp", "dtype": "auto"}}}
    assert config_key(bench)[1] == config_key(evaluation)[1] == "fp fp16" == str(KVSpec(dtype="fp16"))
    assert config_key(default)[1] == "fp"
