"""specquant's own int4 and int8 GEMMs (toolkit/quant/int4_native.py, int8_native.py, c/) and QuantLinear's
"int4n8" path on it: the n8 packing round-trips bit for bit, products equal the dequantized weight's float64
product to fp32 rounding (1e-5 relative; observed ~3e-7), a row's result does not depend on the rows beside it
(speculative verification relies on it), and where the kernel cannot build everything falls back to torch's."""

import logging

import pytest
import torch
import torch.nn.functional as F

from toolkit.engine.precision import cpu_flags
from toolkit.quant import int4_native, int8_native, qlinear
from toolkit.quant.primitives import QuantConfig, choose_qparams, quantize
from toolkit.quant.qlinear import KERNEL_MAX_ROWS, QuantLinear
from toolkit.quant.quantized_weight import QuantizedWeight

TOL = 1e-5
needs_kernel = pytest.mark.skipif(not int4_native.available(),
                                  reason="the int4 GEMM kernel is not built here (no C compiler or no AVX2, or "
                                         "SPECQUANT_NO_KERNELS is set)")


def random_weight(n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    n_groups = -(-k // group)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, n_groups, generator=g) * 0.02 + 1e-3
    zero = torch.randint(0, 16, (n, n_groups), generator=g)
    col_group = torch.arange(k) // group
    w = (codes.double() - zero.double()[:, col_group]) * scale.double()[:, col_group]
    return codes, scale, zero, w


def rel_err(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@needs_kernel
@pytest.mark.parametrize("n,k,group", [(8, 16, 16), (64, 128, 32), (40, 96, 64), (48, 576, 128), (96, 576, 576)])
def test_the_c_dequantize_is_torchs_arithmetic_bit_for_bit(n, k, group):
    """One C pass gives what unpack + (q - zero) * scale in fp32 gives (the prompt's dequantize path), and its bf16
    output is exactly torch's cast of that, for every block range (ragged last groups included)."""
    codes, scale, zero, _ = random_weight(n, k, group)
    scale[0, 0], scale[-1, -1] = 3.0e-3 + 2 ** -20, 1.0 / 3  # values whose bf16 rounding is not a plain truncation
    packed = int4_native.pack(codes, scale, zero, group)
    col_group = torch.arange(k) // group
    ref = (codes.float() - zero.float()[:, col_group]) * scale[:, col_group]
    blocks = n // int4_native.BLOCK_N
    for b0, b1 in ((0, blocks), (blocks // 2, blocks), (0, 1), (blocks - 1, blocks), (1, 1)):
        rows = slice(b0 * 8, b1 * 8)
        for dtype in (torch.float32, torch.bfloat16):
            out = torch.full(((b1 - b0) * 8, k), float("nan"), dtype=dtype)
            assert int4_native.dequantize(*packed, group, b0, b1, out) is out
            assert torch.equal(out, ref[rows].to(dtype)), (b0, b1, dtype)
    with pytest.raises(ValueError, match="contiguous fp32/bf16"):
        int4_native.dequantize(*packed, group, 0, 1, torch.empty(8, k, dtype=torch.float16))
    with pytest.raises(ValueError, match="refused"):
        int4_native.dequantize(*packed, group, 0, blocks + 1, torch.empty((blocks + 1) * 8, k))


@pytest.mark.parametrize("n,k,group", [(8, 16, 16), (64, 128, 32), (40, 96, 64), (48, 576, 128), (96, 576, 576)])
def test_pack_unpack_round_trip(n, k, group):
    codes, scale, zero, _ = random_weight(n, k, group)
    pc, ps, pz = int4_native.pack(codes, scale, zero, group)
    n_groups = -(-k // group)
    assert pc.shape == (n // 8, k // 2, 8) and ps.shape == pz.shape == (n // 8, n_groups, 8)
    assert pc.dtype == pz.dtype == torch.uint8 and ps.dtype == torch.float32
    assert torch.equal(int4_native.unpack_codes(pc), codes)
    assert torch.equal(int4_native.unpack_codes(pc, 1, 3), codes[8:24])
    assert torch.equal(int4_native.blocked_to_rows(ps), scale) and torch.equal(int4_native.blocked_to_rows(pz),
                                                                               zero.to(torch.uint8))
    # the documented byte layout: byte (b, p, j) = q[8b+j, 2p] | q[8b+j, 2p+1] << 4
    b, p, j = n // 8 - 1, k // 2 - 1, 5
    assert int(pc[b, p, j]) == int(codes[8 * b + j, 2 * p]) | int(codes[8 * b + j, 2 * p + 1]) << 4


def test_pack_refuses_shapes_the_layout_cannot_hold():
    codes, scale, zero, _ = random_weight(12, 16, 16)
    with pytest.raises(ValueError, match="out % 8"):
        int4_native.pack(codes, scale, zero, 16)
    assert not int4_native.supports(16, 15, 16) and not int4_native.supports(16, 16, 15)
    assert int4_native.supports(16, 576, 128)  # a short last group is fine


@needs_kernel
@pytest.mark.parametrize("n,k,group", [(8, 16, 16), (64, 128, 32), (40, 96, 64), (1536, 576, 64),
                                       (48, 576, 128), (96, 576, 576), (24, 1536, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_products_equal_the_dequantized_weights_float64_product(n, k, group, bias):
    codes, scale, zero, w = random_weight(n, k, group, seed=n + k)
    pc, ps, pz = int4_native.pack(codes, scale, zero, group)
    b = torch.randn(n) if bias else None
    for rows in (1, 2, 3, 5, 9, 17, 40):
        x = torch.randn(rows, k)
        ref = x.double() @ w.T + (b.double() if bias else 0)
        y = int4_native.linear(x, pc, ps, pz, group, b)
        assert y.shape == (rows, n) and y.dtype == torch.float32
        assert rel_err(y, ref) < TOL, rows


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Bit for bit: M rows at once equal each row alone, at every M the tiling treats differently (1, odd, even)."""
    codes, scale, zero, _ = random_weight(1536, 576, 64)
    pc, ps, pz = int4_native.pack(codes, scale, zero, 64)
    x = torch.randn(17, 576)
    alone = torch.cat([int4_native.linear(x[i:i + 1], pc, ps, pz, 64) for i in range(17)])
    for rows in (2, 3, 4, 9, 17):
        assert torch.equal(int4_native.linear(x[:rows], pc, ps, pz, 64), alone[:rows]), rows
    # strided and half-precision inputs are taken as fp32 contiguous rows
    assert torch.equal(int4_native.linear(x.t().contiguous().t(), pc, ps, pz, 64), alone)


def make_qw(out_f, in_f, group_size, symmetric=False, bias=True):
    w = torch.randn(out_f, in_f) * 0.05
    config = QuantConfig(bits=4, group_size=group_size, symmetric=symmetric)
    scale, zero = choose_qparams(w, config)
    b = torch.randn(out_f) * 0.1 if bias else None
    return QuantizedWeight(quantize(w, scale, zero, config), scale, zero, config, b)


@needs_kernel
@pytest.mark.parametrize("out_f,in_f,gs,sym", [(64, 128, 32, True), (64, 128, 64, False), (40, 128, 64, True),
                                               (96, 576, 128, False), (96, 576, -1, False), (64, 96, 64, True)])
def test_quantlinear_runs_int4n8_exactly_at_every_row_count(out_f, in_f, gs, sym):
    """Shapes torch's int4 kernel refuses (out 40) or pads (576 at g128) run here too; kernel and dequantize paths
    both give the dequantized weight's product to fp32 rounding (torch's kernel: ~1e-2, bf16 activations)."""
    torch.manual_seed(0)
    qw = make_qw(out_f, in_f, gs, sym)
    m = QuantLinear.from_quantized(qw)
    assert m.kernel == "int4n8" and "kernel=int4n8" in repr(m)
    assert list(m.parameters()) == [] and m.nbytes < out_f * in_f  # codes at half a byte, no float weight
    ref_w = qw.dequantize(torch.float64)
    for rows in (1, 3, 16, KERNEL_MAX_ROWS["int4n8"] - 1, KERNEL_MAX_ROWS["int4n8"], KERNEL_MAX_ROWS["int4n8"] + 34):
        x = torch.randn(rows, in_f)
        y = m(x)
        assert y.shape == (rows, out_f)
        assert rel_err(y, x.double() @ ref_w.T + qw.bias.double()) < TOL, rows
    assert torch.equal(m.dequantized_weight(), qw.dequantize(torch.float32))
    x3 = torch.randn(2, 3, in_f).to(torch.bfloat16)
    y3 = m(x3)
    assert y3.shape == (2, 3, out_f) and y3.dtype == torch.bfloat16


@needs_kernel
def test_int4_kernel_is_the_native_one_unless_switched_off(monkeypatch):
    qw = make_qw(64, 128, 32)
    assert qlinear.int4_kernel() == "int4n8" and QuantLinear.from_quantized(qw).kernel == "int4n8"
    monkeypatch.setattr(QuantLinear, "native_kernels", False)
    assert qlinear.int4_kernel() == "int4pack" and QuantLinear.from_quantized(qw).kernel == "int4pack"


def test_without_a_compiler_int4_layers_fall_back_to_torchs_kernel(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.delenv("SPECQUANT_NO_KERNELS", raising=False)
    int4_native.kernel.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="toolkit.quant.int4_native"):
            assert int4_native.kernel() is None
        assert "did not build" in caplog.text and "torch's int4 kernel" in caplog.text
        assert not list(tmp_path.glob("kernels/*.so"))
        qw = make_qw(64, 128, 32)
        m = QuantLinear.from_quantized(qw)
        assert m.kernel == "int4pack"
        x = torch.randn(2, 128)
        assert rel_err(m(x), F.linear(x.double(), qw.dequantize(torch.float64), qw.bias.double())) < 1.5e-2
    finally:
        int4_native.kernel.cache_clear()


def test_the_switch_off_variable_disables_the_kernel(monkeypatch):
    monkeypatch.setenv("SPECQUANT_NO_KERNELS", "1")
    assert int4_native.load() is None


# ------------------------------------------------------------------------------------------------- int8

needs_int8_kernel = pytest.mark.skipif(not int8_native.available(),
                                       reason="the int8 GEMM kernel is not built here (no C compiler or no AVX2, "
                                              "or SPECQUANT_NO_KERNELS is set)")


@needs_int8_kernel
@pytest.mark.parametrize("n,k", [(16, 1), (16, 8), (48, 5), (64, 128), (80, 96), (1536, 576), (576, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_products_equal_the_float64_product_and_rows_are_independent(n, k, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    s = torch.rand(n, generator=g) * 0.01 + 1e-4
    b = torch.randn(n, generator=g) if bias else None
    wf = w.double() * s.double()[:, None]
    x = torch.randn(17, k, generator=g)
    packed = int8_native.pack(w)
    alone = torch.cat([int8_native.linear(x[i:i + 1], packed, s, b) for i in range(17)])
    assert rel_err(alone, x.double() @ wf.T + (b.double() if bias else 0)) < TOL
    for rows in (2, 3, 4, 5, 6, 7, 9, 13, 17):  # 6 rows a pass on AVX512, then a shorter pass of the rest
        assert torch.equal(int8_native.linear(x[:rows], packed, s, b), alone[:rows]), rows


@pytest.mark.parametrize("n,k", [(16, 3), (64, 576), (80, 96), (208, 40)])
def test_the_int8_pack_is_the_h16_order_and_round_trips(n, k):
    """Element (k, b, j) of tile t is W[16(4t+b)+j, k] (the last tile holding fewer blocks); `rows` gives any whole
    tiles back."""
    w = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(n)).to(torch.int8)
    packed = int8_native.pack(w)
    assert packed.dtype == torch.int8 and packed.numel() == n * k
    for t in range(-(-n // 64)):
        nt = min(4, (n - 64 * t) // 16)
        tile = packed[64 * t * k:(64 * t + 16 * nt) * k].view(k, nt, 16)
        for b in range(nt):
            assert torch.equal(tile[:, b, :], w[64 * t + 16 * b:64 * t + 16 * (b + 1)].T)
    assert torch.equal(int8_native.rows(packed, n, k), w)
    for n0 in range(0, n, 64):
        assert torch.equal(int8_native.rows(packed, n, k, n0, min(n0 + 64, n)), w[n0:n0 + 64])
    with pytest.raises(ValueError, match="whole tiles"):
        int8_native.rows(packed, n, k, 16, n)
    with pytest.raises(ValueError, match="N % 16"):
        int8_native.pack(w[:-1])


@needs_int8_kernel
def test_avx2_and_avx512_builds_of_the_int8_gemm_agree_bit_for_bit():
    """The AVX2 build (one row a pass, 8-wide registers) sums each output in the same order as the AVX512 build (six
    rows a pass), so a checkpoint gives the same products on either CPU."""
    if "avx512f" not in cpu_flags():
        pytest.skip("this CPU has no AVX512F: only the AVX2 build runs here")
    avx2 = int8_native.load(tuple(int8_native.FLAGS) + ("-mno-avx512f",))
    assert avx2 is not None
    g = torch.Generator().manual_seed(1)
    n, k = 208, 96
    w = torch.randint(-127, 128, (n, k), generator=g).to(torch.int8)
    s, b, x = torch.rand(n, generator=g) + 0.01, torch.randn(n, generator=g), torch.randn(9, k, generator=g)
    packed = int8_native.pack(w)
    y = torch.empty(9, n)
    assert avx2.sq_int8_linear(x.data_ptr(), 9, k, packed.data_ptr(), s.data_ptr(), b.data_ptr(), n, y.data_ptr()) == 0
    assert torch.equal(y, int8_native.linear(x, packed, s, b))


@needs_int8_kernel
def test_quantlinear_int8_layers_run_the_native_gemm_exactly_up_to_the_int8_prefill_path():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 0.05
    config = QuantConfig(bits=8, group_size=-1, symmetric=True)
    scale, zero = choose_qparams(w, config)
    qw = QuantizedWeight(quantize(w, scale, zero, config), scale, zero, config, torch.randn(64) * 0.1)
    m = QuantLinear.from_quantized(qw)
    assert m.kernel == "int8pack" and m.int8_native and "specquant int8 GEMM" in repr(m)
    # one copy of the codes (the kernel's h16 order) and no bf16 scales for torch's kernel
    assert not hasattr(m, "scale_bf16") and not hasattr(m, "weight_int8")
    assert torch.equal(m.int8_rows(), (qw.codes.to(torch.int16) - 128).to(torch.int8))
    assert m.nbytes == 64 * 128 + 2 * 64 * 4  # codes, fp32 scales and bias
    ref_w = qw.dequantize(torch.float64)
    for rows in (1, 5, 33, m.kernel_max_rows - 1):
        x = torch.randn(rows, 128)
        assert rel_err(m(x), x.double() @ ref_w.T + qw.bias.double()) < TOL, rows


def test_with_native_kernels_off_int8_layers_run_torchs_kernel(monkeypatch):
    monkeypatch.setattr(QuantLinear, "native_kernels", False)
    w = torch.randn(64, 128) * 0.05
    config = QuantConfig(bits=8, group_size=-1, symmetric=True)
    scale, zero = choose_qparams(w, config)
    m = QuantLinear.from_quantized(QuantizedWeight(quantize(w, scale, zero, config), scale, zero, config))
    assert m.kernel == "int8pack" and not m.int8_native and m.scale_bf16.dtype == torch.bfloat16


@needs_int8_kernel
def test_int8_layers_whose_outputs_the_int8_gemm_cannot_tile_run_torchs_kernel():
    w = torch.randn(72, 128) * 0.05  # 72 outputs: not whole blocks of 16
    config = QuantConfig(bits=8, group_size=-1, symmetric=True)
    scale, zero = choose_qparams(w, config)
    qw = QuantizedWeight(quantize(w, scale, zero, config), scale, zero, config)
    m = QuantLinear.from_quantized(qw)
    assert m.kernel == "int8pack" and not m.int8_native and m.weight_int8.shape == (72, 128)
    x = torch.randn(3, 128)
    assert rel_err(m(x), x.double() @ qw.dequantize(torch.float64).T) < 1e-2  # bf16 activations


def test_the_engine_setting_picks_the_kernels(monkeypatch):
    from toolkit.engine.setup import choose_lowbit_kernels
    from toolkit.errors import InputError

    monkeypatch.setattr(QuantLinear, "native_kernels", True)
    choose_lowbit_kernels("torch")
    assert QuantLinear.native_kernels is False
    choose_lowbit_kernels("auto")
    assert QuantLinear.native_kernels is True
    with pytest.raises(InputError, match="lowbit_kernel"):
        choose_lowbit_kernels("fast")
