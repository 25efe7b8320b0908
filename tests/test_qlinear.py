"""QuantLinear against the dequantized float reference ``F.linear(x, qw.dequantize(fp32), bias)``.

Tolerances, as max |y - ref| / max |ref| over the output:
* kernel paths (int8pack / int4pack, bf16 activations, bf16 output, bf16 scales): 1.5e-2 (observed ~3-6e-3).
* dequant / fp32 path: 1e-5 (same fp32 weight values, only the summation order differs; observed ~1e-7).
* int8pack from INT8_DYNAMIC_MIN_ROWS rows on (int8 x int8, activations quantized per row to 7 bits): 5e-2 as max
  error and 3e-2 as ||y - ref|| / ||ref|| on Gaussian inputs (observed ~2e-2 and ~1e-2: a 7-bit code's rounding
  error is up to 1/126 of the row's largest |x|, ~1/30 of a typical value at 4 sigma).
"""

import pytest
import torch
import torch.nn.functional as F

from toolkit.quant.primitives import QuantConfig, choose_qparams, quantize
from toolkit.quant import int8_dynamic
from toolkit.quant.qlinear import INT8_DYNAMIC_MIN_ROWS, KERNEL_MAX_ROWS, QuantLinear, exact_prefill, weight_bytes
from toolkit.quant.quantized_weight import QuantizedWeight

KERNEL_TOL, FP32_TOL, DYNAMIC_TOL, DYNAMIC_NORM_TOL = 1.5e-2, 1e-5, 5e-2, 3e-2
needs_onednn = pytest.mark.skipif(not int8_dynamic.available(), reason="this torch lacks the oneDNN int8 ops")


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    torch.manual_seed(0)
    # these tests pin torch's kernels (int4pack); specquant's own int4 GEMM (int4n8) is tested in test_native_gemm.py
    monkeypatch.setattr(QuantLinear, "native_kernels", False)


def make_qw(out_f, in_f, bits, group_size, symmetric=True, bias=True, g_idx=None):
    w = torch.randn(out_f, in_f) * 0.05
    config = QuantConfig(bits=bits, group_size=group_size, symmetric=symmetric)
    scale, zero = choose_qparams(w, config)
    b = torch.randn(out_f) * 0.1 if bias else None
    return QuantizedWeight(quantize(w, scale, zero, config), scale, zero, config, b, g_idx)


def rel_err(y, ref):
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def norm_err(y, ref):
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def tolerance(m, rows):
    """The bound for a product of `rows` rows on QuantLinear `m`, by the path it takes."""
    if rows < m.kernel_max_rows:
        return KERNEL_TOL
    if m.kernel == "int8pack" and rows >= INT8_DYNAMIC_MIN_ROWS and int8_dynamic.available():
        return DYNAMIC_TOL
    return FP32_TOL


def reference(qw, x):
    return F.linear(x.float(), qw.dequantize(torch.float32), qw.bias)


def buffer_bytes(m):
    return sum(b.numel() * b.element_size() for b in m.buffers())


CASES = [  # (out, in, bits, group_size, symmetric, expected kernel)
    (64, 128, 8, -1, True, "int8pack"),
    (48, 96, 8, -1, True, "int8pack"),
    (64, 128, 8, 32, True, "dequant"),  # grouped 8-bit: the int8 kernel is per-channel only
    (64, 128, 8, -1, False, "dequant"),  # asymmetric 8-bit
    (64, 128, 4, 32, True, "int4pack"),
    (64, 128, 4, 64, False, "int4pack"),
    (48, 256, 4, 128, True, "int4pack"),  # 48 rows: a 32-row packed block plus a 16-row tail
    (96, 576, 4, -1, False, "int4pack"),  # per-channel runs as kernel group 64 with repeated scales
    (40, 128, 4, 64, True, "dequant"),  # out % 16 != 0: the int4 kernel refuses it
    (64, 128, 3, 32, True, "dequant"),
    (64, 128, 3, -1, False, "dequant"),
    (64, 128, 2, 64, False, "dequant"),
    (40, 96, 2, 32, True, "dequant"),
    # a ragged last group (SmolLM2's 576 at g128: 4 whole groups and one of 64): int4 runs zero-padded
    (96, 576, 4, 128, False, "int4pack"),
    (48, 576, 4, 128, True, "int4pack"),
    (64, 96, 4, 64, False, "int4pack"),
    (64, 576, 3, 128, False, "dequant"),
    (64, 96, 8, 64, True, "dequant"),
]


@pytest.mark.parametrize("out_f,in_f,bits,gs,sym,kernel", CASES)
def test_matches_dequantized_reference(out_f, in_f, bits, gs, sym, kernel):
    qw = make_qw(out_f, in_f, bits, gs, sym)
    m = QuantLinear.from_quantized(qw)
    assert m.kernel == kernel
    assert f"bits={bits}" in repr(m) and f"kernel={kernel}" in repr(m)
    max_rows = KERNEL_MAX_ROWS.get(kernel, 0)
    for rows in (1, 3, 16, max_rows or 32, INT8_DYNAMIC_MIN_ROWS - 1, INT8_DYNAMIC_MIN_ROWS, 130):
        x = torch.randn(rows, in_f)
        y = m(x)
        assert y.shape == (rows, out_f) and y.dtype == torch.float32
        tol = tolerance(m, rows)
        assert rel_err(y, reference(qw, x)) < tol, (rows, tol)


@pytest.mark.parametrize("out_f,in_f,bits,gs,sym,kernel", CASES)
def test_holds_no_float_weight_and_nbytes_counts_buffers(out_f, in_f, bits, gs, sym, kernel):
    m = QuantLinear.from_quantized(make_qw(out_f, in_f, bits, gs, sym))
    assert list(m.parameters()) == []
    for b in m.buffers():
        assert not (b.is_floating_point() and b.shape in ((out_f, in_f), (in_f, out_f)))
    assert m.nbytes == buffer_bytes(m)
    code_bytes = {"int8pack": out_f * in_f, "int4pack": out_f * in_f // 2}.get(kernel)
    if code_bytes is None:  # dequant storage: 4 bits two per byte, 2 bits four per byte, 3 / 8 bits one per byte
        code_bytes = out_f * in_f * {4: 1, 2: 1, 3: 4, 8: 4}[bits] // 4 if bits != 4 else out_f * in_f // 2
    if kernel == "int4pack" and m._code_layout == "int4_rows":  # a CPU whose int4 layout is unknown (AVX512): the
        # kernel's own pack (its input width padded to the group) and a portable copy of the codes for the fp32 path
        code_bytes = m.weight_int4pack.nbytes + m.codes.nbytes
    assert m.nbytes < code_bytes + 4 * out_f * in_f // 8  # far below the 4 bytes/weight of fp32
    assert m.nbytes >= code_bytes


def test_int4pack_fp32_path_reads_the_kernel_layout():
    """On this CPU the fp32 path decodes the kernel's own packed bytes (no second copy of the codes)."""
    m = QuantLinear.from_quantized(make_qw(48, 256, 4, 128))
    assert m._code_layout in ("packed", "int4_rows")
    if m._code_layout == "packed":
        assert not hasattr(m, "codes") and m.nbytes < 48 * 256 // 2 + 48 * 2 * (4 + 1 + 4) + 48 * 4 + 1


def test_empty_input():
    m = QuantLinear.from_quantized(make_qw(64, 128, 4, 32))
    assert m(torch.randn(0, 128)).shape == (0, 64)


def test_bias_is_added_and_optional():
    qw = make_qw(64, 128, 4, 32, bias=False)
    m = QuantLinear.from_quantized(qw)
    assert m.bias is None and "bias=False" in repr(m)
    x = torch.randn(2, 128)
    assert rel_err(m(x), reference(qw, x)) < KERNEL_TOL
    qwb = QuantizedWeight(qw.codes, qw.scale, qw.zero, qw.config, torch.full((64,), 3.0))
    mb = QuantLinear.from_quantized(qwb)
    torch.testing.assert_close(mb(x) - m(x), torch.full((2, 64), 3.0))


@pytest.mark.parametrize("bits,gs", [(4, 64), (8, -1), (3, 32)])
def test_3d_input_and_half_activations(bits, gs):
    qw = make_qw(64, 128, bits, gs)
    m = QuantLinear.from_quantized(qw)
    for shape in ((1, 1, 128), (2, 3, 128), (2, 70, 128)):  # decode, verify batch, prefill
        x = torch.randn(*shape)
        y = m(x)
        assert y.shape == (*shape[:-1], 64)
        ref = reference(qw, x.reshape(-1, 128)).reshape(*shape[:-1], 64)
        assert rel_err(y, ref) < tolerance(m, x.numel() // 128)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(2, 5, 128).to(dtype)
        y = m(x)
        assert y.dtype == dtype
        assert rel_err(y, reference(qw, x.reshape(-1, 128)).reshape(2, 5, 64)) < KERNEL_TOL


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (3, 32), (8, 64)])  # 96 = 64 + a ragged 32 at g64
def test_act_order_layers_gather_their_inputs_and_run_the_plain_paths(bits, gs):
    """An act-order g_idx (GPTQ's desc_act: each group `gs` channels, scattered) runs as a plain grouped layer on
    inputs gathered into group order: the same kernel a trivial g_idx gets, products equal to the dequantized
    reference at every row count, the float weight given back in the inputs' own order."""
    qw = make_qw(64, 96, bits, gs, symmetric=False)
    perm = torch.randperm(96, generator=torch.Generator().manual_seed(gs))
    position = torch.argsort(perm)  # channel c is quantized at position[c], in group position[c] // gs
    g_idx = (position // gs).to(torch.int32)
    config = qw.config
    wp = (torch.randn(64, 96) * 0.05)[:, perm]  # the weight in quantization order
    scale, zero = choose_qparams(wp, config)
    codes = quantize(wp, scale, zero, config)[:, position]  # back to the channels' own order
    act = QuantizedWeight(codes, scale, zero, config, qw.bias, g_idx)
    m = QuantLinear.from_quantized(act)
    order = m.in_perm.long()  # channels sorted by group (each group's in ascending index)
    assert torch.equal(g_idx[order].long(), torch.arange(96) // gs) and "act-order" in repr(m)
    plain = QuantLinear.from_quantized(QuantizedWeight(codes[:, order], scale, zero, config, qw.bias))
    assert m.kernel == plain.kernel  # (a dequant layer with a ragged last group keeps the trivial g_idx, as plain)
    assert not hasattr(m, "g_idx") or torch.equal(m.g_idx.long(), torch.arange(96) // gs)
    for rows in (1, 5, 70, 300):
        x = torch.randn(rows, 96)
        assert rel_err(m(x), reference(act, x)) < tolerance(m, rows), rows
        assert torch.equal(m(x), plain(x[:, order])), rows
    torch.testing.assert_close(m.dequantized_weight(), act.dequantize(torch.float32), rtol=0, atol=0)


def test_g_idx_with_uneven_groups_takes_the_dequant_path():
    qw = make_qw(64, 128, 4, 32)
    g_idx = torch.randint(0, 4, (128,), generator=torch.Generator().manual_seed(0)).to(torch.int32)
    g_idx[:4] = torch.arange(4, dtype=torch.int32)  # every group present, of uneven sizes
    qw = QuantizedWeight(qw.codes, qw.scale, qw.zero, qw.config, qw.bias, g_idx)
    m = QuantLinear.from_quantized(qw)
    assert m.kernel == "dequant" and m.in_perm is None
    x = torch.randn(3, 128)
    assert rel_err(m(x), reference(qw, x)) < FP32_TOL
    trivial = QuantizedWeight(qw.codes, qw.scale, qw.zero, qw.config, qw.bias, torch.arange(128) // 32)
    assert QuantLinear.from_quantized(trivial).kernel != "dequant"


def test_blockwise_dequant_matches(monkeypatch):
    import toolkit.quant.qlinear as qlinear

    monkeypatch.setattr(qlinear, "_DEQUANT_BLOCK_ELEMS", 64 * 128)  # force several blocks (int4pack: 32-row aligned)
    for bits, gs, out_f in ((4, 64, 208), (8, -1, 200), (3, 32, 200), (2, 32, 200)):
        qw = make_qw(out_f, 128, bits, gs)
        m = QuantLinear.from_quantized(qw)
        assert len(m._blocks()) > 1
        x = torch.randn(130, 128)
        with exact_prefill():  # the blocks are the dequant path's
            assert rel_err(m(x), reference(qw, x)) < FP32_TOL


def test_grad_enabled_input_does_not_alias_scratch():
    qw = make_qw(64, 128, 8, -1)
    m = QuantLinear.from_quantized(qw)
    x = torch.randn(130, 128, requires_grad=True)
    y = m(x)  # autograd needs x: the exact path, never int8 x int8
    with exact_prefill():
        m(torch.randn(130, 128))  # reuses the scratch buffer
    y.sum().backward()
    torch.testing.assert_close(x.grad, qw.dequantize().sum(0).expand(130, 128), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------- int8 x int8 prefill path


def _spy_dynamic(monkeypatch):
    calls = []
    real = int8_dynamic.linear

    def spy(x, *args):
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(int8_dynamic, "linear", spy)
    return calls


@needs_onednn
def test_int8_path_is_chosen_by_rows(monkeypatch):
    calls = _spy_dynamic(monkeypatch)
    qw = make_qw(64, 128, 8, -1)
    m = QuantLinear.from_quantized(qw)
    kernel_rows, dynamic_rows = KERNEL_MAX_ROWS["int8pack"], INT8_DYNAMIC_MIN_ROWS
    assert 1 < kernel_rows < dynamic_rows
    for rows, tol, dynamic in ((kernel_rows - 1, KERNEL_TOL, False), (kernel_rows, FP32_TOL, False),
                               (dynamic_rows - 1, FP32_TOL, False), (dynamic_rows, DYNAMIC_TOL, True)):
        calls.clear()
        x = torch.randn(rows, 128)
        assert rel_err(m(x), reference(qw, x)) < tol, rows
        assert calls == ([rows] if dynamic else []), rows
    calls.clear()
    x = torch.randn(2, dynamic_rows, 128)  # rows count over the leading dims
    y = m(x)
    assert calls == [2 * dynamic_rows] and y.shape == (2, dynamic_rows, 64)
    calls.clear()
    with exact_prefill():
        assert rel_err(m(x), reference(qw, x.reshape(-1, 128)).reshape(2, -1, 64)) < FP32_TOL
    assert calls == [] and QuantLinear.int8_activations
    m(torch.randn(dynamic_rows, 128, requires_grad=True))  # autograd needs x: exact path
    assert calls == []
    int4 = QuantLinear.from_quantized(make_qw(64, 128, 4, 32))
    int4(torch.randn(dynamic_rows, 128))
    assert calls == []  # int4 layers have no int8 codes to multiply


@needs_onednn
def test_int8_dynamic_is_exact_on_representable_rows():
    """Rows that are exactly a * c / 63 with integer c in -63..63 (one |c| = 63 per row) quantize without error, so
    the int8 x int8 product equals the fp32 reference up to summation order: checks scales, zero point and the
    per-row rescaling. Outlier channels (huge values here) are computed in fp32 and must not disturb that."""
    qw = make_qw(96, 256, 8, -1, bias=True)
    m = QuantLinear.from_quantized(qw)
    rows = INT8_DYNAMIC_MIN_ROWS + 6
    codes = torch.randint(-63, 64, (rows, 256))
    codes[torch.arange(rows), torch.randint(0, 256, (rows,))] = 63
    a = torch.rand(rows, 1) * 10 + 0.01
    x = codes.float() * (a / 63)
    assert rel_err(int8_dynamic.linear(x, m.int8_rows(), m.scale, torch.zeros(96, dtype=torch.int32), 0),
                   F.linear(x, qw.dequantize(torch.float32))) < FP32_TOL
    n_out = int8_dynamic.outlier_channels(256)
    assert n_out == 8
    x[:, 5:5 + n_out] = torch.randn(rows, n_out) * 1e4  # every row's largest values, in the outlier channels
    assert rel_err(m(x), reference(qw, x)) < FP32_TOL


@needs_onednn
def test_int8_dynamic_error_on_outliers_is_bounded():
    """LLM-like inputs: a few channels 40x the rest, a few rows 300x (massive activations). Per-row scales and the
    fp32 outlier channels keep the error at the Gaussian level; without outlier channels it is several times
    larger (the bound this test states is for the path QuantLinear runs)."""
    qw = make_qw(128, 512, 8, -1)
    m = QuantLinear.from_quantized(qw)
    x = torch.randn(200, 512)
    x[:, torch.randperm(512)[:6]] *= 40
    x[torch.randperm(200)[:3]] *= 300
    ref = reference(qw, x)
    y = m(x)
    assert norm_err(y, ref) < DYNAMIC_NORM_TOL and rel_err(y, ref) < DYNAMIC_TOL
    plain = int8_dynamic.linear(x, m.int8_rows(), m.scale, torch.zeros(128, dtype=torch.int32), 0)
    assert norm_err(plain - qw.bias, ref) > 3 * norm_err(y, ref)


@needs_onednn
def test_int8_dynamic_non_finite_rows_take_the_exact_path():
    qw = make_qw(64, 128, 8, -1)
    m = QuantLinear.from_quantized(qw)
    x = torch.randn(INT8_DYNAMIC_MIN_ROWS, 128)
    x[3, 7] = float("inf")
    x[9, 2] = float("nan")
    with exact_prefill():
        exact = m(x)
    torch.testing.assert_close(m(x), exact, equal_nan=True)


@needs_onednn
def test_int8_dynamic_holds_nothing_new_and_keeps_dtype():
    qw = make_qw(64, 128, 8, -1)
    m = QuantLinear.from_quantized(qw)
    before = {name: (b.data_ptr(), b.numel()) for name, b in m.named_buffers()}
    nbytes, attrs = m.nbytes, set(vars(m))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(INT8_DYNAMIC_MIN_ROWS, 128).to(dtype)
        y = m(x)
        assert y.dtype == dtype
        assert rel_err(y, reference(qw, x)) < DYNAMIC_TOL + (1e-2 if dtype != torch.float32 else 0)
    assert {name: (b.data_ptr(), b.numel()) for name, b in m.named_buffers()} == before
    assert m.nbytes == nbytes and set(vars(m)) == attrs  # the reordered weight is a per-call temporary


# -------------------------------------------------------------------------------------------- model swap


def _quantize_linears(model, bits, group_size):
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and f"{name}.{child_name}".lstrip(".") != "lm_head":
                w = child.weight.detach()
                config = QuantConfig(bits=bits, group_size=group_size)
                scale, zero = choose_qparams(w, config)
                qw = QuantizedWeight(quantize(w, scale, zero, config), scale, zero, config, child.bias)
                setattr(module, child_name, QuantLinear.from_quantized(qw))


@pytest.mark.parametrize("bits,gs,kernel", [(4, 32, "int4pack"), (8, -1, "int8pack"), (3, 32, "dequant")])
def test_swapped_into_tiny_llama(bits, gs, kernel):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    float_bytes = weight_bytes(model)
    assert float_bytes == sum(p.numel() * 4 for p in model.parameters())  # tied embedding / head counted once
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
        _quantize_linears(model, bits, gs)
        layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert len(layers) == 14 and {m.kernel for m in layers} == {kernel}
        prefill = model(ids).logits  # 18 rows: the kernel for int4 / int8, the dequant path for 3 bits
        long = model(ids.repeat(1, 8)).logits  # 144 rows: int8 x int8 (int8), dequantize + fp32 F.linear (others)
        step = model(ids[:, :1]).logits  # 2 rows: the kernel
    assert torch.isfinite(prefill).all() and torch.isfinite(step).all() and torch.isfinite(long).all()
    assert prefill.shape == ref.shape
    assert (prefill - ref).abs().max() < 0.5 * ref.abs().max()  # quantization noise, not garbage
    quant_bytes = weight_bytes(model)
    assert quant_bytes == sum(m.nbytes for m in layers) + sum(p.numel() * 4 for p in model.parameters())
    assert quant_bytes < float_bytes


def test_scratch_made_under_inference_mode_works_outside_it(monkeypatch):
    import toolkit.quant.qlinear as qlinear

    monkeypatch.setattr(qlinear, "_SCRATCH", __import__("threading").local())  # the next call allocates afresh
    qw = make_qw(64, 128, 4, 32)
    m = QuantLinear.from_quantized(qw)
    x = torch.randn(130, 128)
    with torch.inference_mode():
        m(x)
    assert rel_err(m(x), reference(qw, x)) < FP32_TOL
