"""The fused KV dequantization kernel (toolkit/kv/native.py, toolkit/kernels/dequant.c): bit-equal to the torch
ops it replaces, in both its AVX2 and its portable build, and never required (no compiler -> torch ops)."""

import logging

import pytest
import torch

from toolkit.kv import native
from toolkit.kv.config import KVQuantConfig
from toolkit.kv.quantized_cache import QuantizedKVLayer
from toolkit.kv.rope import RotaryTable

needs_kernel = pytest.mark.skipif(native.kernel() is None,
                                  reason="the KV kernel is not built here (no C compiler, or SPECQUANT_NO_KERNELS set)")


def _inv_freq(D: int) -> torch.Tensor:
    return 1.0 / (100000 ** (torch.arange(0, D, 2).float() / D))


def _reads(cfg: KVQuantConfig, dtype, B=2, H=3, T=300, D=64, seed=0):
    """What attention reads from a layer filled with T random tokens, then one more decode step."""
    torch.manual_seed(seed)
    layer = QuantizedKVLayer(T + 8, cfg, rope=RotaryTable(_inv_freq(D), T + 8, cfg.group_size))
    k, v = (torch.randn(B, H, T, D) * 2).to(dtype), torch.randn(B, H, T, D).to(dtype)
    k[..., 3] += 5  # an outlier channel, as real keys have
    layer.update(k, v)
    assert layer.quantized > 0 and (layer.v_quantized > layer.quantized or cfg.group_size == 8)  # and staged keys
    keys, values = layer.update(torch.randn(B, H, 1, D).to(dtype), torch.randn(B, H, 1, D).to(dtype))
    return keys.clone(), values.clone()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group,pre_rope", [(2, 32, True), (2, 128, True), (2, 64, False), (4, 32, False),
                                                 (4, 128, True), (8, 32, False), (8, 8, True)])
def test_kernel_reads_equal_torch_ops_bit_for_bit(dtype, bits, group, pre_rope):
    common = dict(bits=bits, group_size=group, residual=16, pre_rope=pre_rope, value_clip=bits == 2)
    ref = _reads(KVQuantConfig(**common, dequant="torch"), dtype)
    got = _reads(KVQuantConfig(**common, dequant="full"), dtype)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@needs_kernel
def test_the_kernel_is_what_the_cache_uses():
    """Guards against a silently dead fast path: with kv.dequant=full the kernel is called, with torch it is not."""
    calls = []
    real = native.dequantize

    def spy(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    native_mod = native
    try:
        native_mod.dequantize = spy
        _reads(KVQuantConfig(bits=4, group_size=32, residual=16), torch.float32)
        assert set(calls) == {"keys", "values"}
        calls.clear()
        _reads(KVQuantConfig(bits=4, group_size=32, residual=16, dequant="torch"), torch.float32)
        assert calls == []
    finally:
        native_mod.dequantize = real


@needs_kernel
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_portable_build_equals_avx2_build(bits, tmp_path, monkeypatch):
    """The plain-C path (what a CPU without AVX2 runs) gives the same values as the AVX2 one."""
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path))
    portable = native.load((*native.FLAGS, "-mno-avx2"))
    assert portable is not None
    torch.manual_seed(bits)
    B, H, T, D, G = 2, 3, 256, 64, 64
    codes = torch.randint(0, 256, (B, H, T, D * bits // 8), dtype=torch.uint8)
    ks, km = torch.rand(B, H, T // G, 1, D).half(), torch.randn(B, H, T // G, 1, D).half()
    vs, vm = torch.rand(B, H, T, D // 32, 1).half(), torch.randn(B, H, T, D // 32, 1).half()
    table = RotaryTable(_inv_freq(D), T, G)
    for lib in (None, portable):
        out_k, out_v = torch.empty(B, H, T, D), torch.empty(B, H, T, D)
        native.dequantize("keys", codes, ks, km, out_k, bits, G, table.cos, table.sin, lib=lib)
        native.dequantize("values", codes, vs, vm, out_v, bits, 32, lib=lib)
        if lib is None:
            ref_k, ref_v = out_k, out_v
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    # and both are codes * scale + min, rotated back: check against an independent computation for the values
    from toolkit.kv.quantize import unpack
    expect = (unpack(codes, bits).view(B, H, T, D // 32, 32).float() * vs.float() + vm.float()).view(B, H, T, D)
    assert torch.equal(ref_v, expect)


def test_without_a_compiler_the_cache_falls_back_to_torch_ops(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv("SPECQUANT_NO_KERNELS", raising=False)
    native.kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="toolkit.kv.native"):
            assert native.kernel() is None
        assert "did not build" in caplog.text and "torch ops" in caplog.text
        assert not (tmp_path / "kernels").exists() or not any((tmp_path / "kernels").glob("*.so"))
        cfg = dict(bits=2, group_size=32, residual=16, pre_rope=True, value_clip=True)
        got = _reads(KVQuantConfig(**cfg), torch.float32)  # runs, on torch ops
        ref = _reads(KVQuantConfig(**cfg, dequant="torch"), torch.float32)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    finally:
        native.kernel.cache_clear()


@needs_kernel
def test_a_failed_build_leaves_no_partial_library(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path))
    monkeypatch.delenv("SPECQUANT_NO_KERNELS", raising=False)
    assert native.load(("-O3", "-fno-such-option-anywhere", "-shared", "-fPIC")) is None
    assert not any((tmp_path / "kernels").glob("*.so"))
