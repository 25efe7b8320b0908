"""Property tests of toolkit.quant.primitives: qparams, quantize/dequantize error bounds, packing formats."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from toolkit.quant.primitives import (
    QuantConfig,
    choose_qparams,
    dequantize,
    gptq_g_idx,
    gptq_scales,
    pack_gptq,
    pack_int4_rows,
    quantize,
    search_qparams,
    unpack_gptq,
    unpack_int4_rows,
)

FAST = settings(max_examples=60, deadline=None)
BITS = st.sampled_from([2, 3, 4, 8])


@st.composite
def weights_and_config(draw, symmetric=None):
    """A small weight [out, n_groups*gs] with adversarial values (zeros, repeats, one sign) and a config."""
    bits = draw(BITS)
    gs = draw(st.sampled_from([32, 64]))
    sym = draw(st.booleans()) if symmetric is None else symmetric
    out, n_groups = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    magnitude = draw(st.sampled_from([2.0**-10, 1.0, 2.0**10]))
    elements = st.floats(-magnitude, magnitude, width=32, allow_subnormal=False)
    w = draw(arrays(np.float32, (out, n_groups * gs), elements=elements))
    return torch.from_numpy(w), QuantConfig(bits=bits, group_size=gs, symmetric=sym)


def _per_element(t: torch.Tensor, config: QuantConfig, in_features: int) -> torch.Tensor:
    """Broadcast a per-group [out, n_groups] tensor to [out, in]."""
    return t.repeat_interleave(config.resolve_group_size(in_features), dim=1)


# ------------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize("field,value", [
    ("bits", 1), ("bits", 5), ("bits", 16), ("bits", True), ("bits", 4.0),
    ("group_size", 0), ("group_size", 16), ("group_size", 48), ("group_size", -2), ("group_size", 100),
    ("symmetric", "yes"), ("symmetric", 1),
])
def test_bad_config_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"QuantConfig.{field} must be"):
        QuantConfig(**{field: value})


def test_config_is_frozen_and_defaults_are_valid():
    config = QuantConfig()
    assert (config.bits, config.group_size, config.symmetric, config.maxq) == (4, 128, True, 15)
    with pytest.raises(Exception):
        config.bits = 8


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape,gs", [((5, 96), 64), ((3, 40), 32), ((4, 576), 128)])
def test_ragged_last_group_quantizes_as_if_zero_padded(bits, symmetric, shape, gs):
    """A group size that does not divide the width leaves a short last group (SmolLM2's 576 at 128): the same
    qparams and codes as the weight zero-padded to whole groups, since the range always contains 0."""
    torch.manual_seed(bits)
    config = QuantConfig(bits=bits, group_size=gs, symmetric=symmetric)
    w = torch.randn(*shape) + 0.3  # mostly positive groups: padding with 0 must still change nothing
    padded = torch.nn.functional.pad(w, (0, -shape[1] % gs))
    assert config.n_groups(shape[1]) == padded.shape[1] // gs and not config.divides(shape[1])
    scale, zero = choose_qparams(w, config)
    pscale, pzero = choose_qparams(padded, config)
    assert torch.equal(scale, pscale) and torch.equal(zero, pzero)
    q = quantize(w, scale, zero, config)
    assert q.shape == w.shape and torch.equal(q, quantize(padded, scale, zero, config)[:, :shape[1]])
    assert torch.equal(dequantize(q, scale, zero, config),
                       dequantize(quantize(padded, scale, zero, config), scale, zero, config)[:, :shape[1]])
    # the padded columns land on the zero point: they dequantize to exactly 0, so padding x with zeros is exact
    assert bool((quantize(padded, scale, zero, config)[:, shape[1]:] == zero[:, -1:]).all())


def test_non_finite_or_non_2d_weight_raises():
    with pytest.raises(ValueError, match="NaN or Inf"):
        choose_qparams(torch.tensor([[float("nan")] * 32]), QuantConfig(group_size=32))
    with pytest.raises(ValueError, match="2-D"):
        choose_qparams(torch.zeros(32), QuantConfig(group_size=32))


# ------------------------------------------------------------------------------------------------ qparams


def test_qparams_match_gptq_conventions_on_a_hand_example():
    # group_size=-1 on 4 inputs, 4 bits (maxq = 15). Rows: mixed signs, all >= 0, all zero.
    w = torch.tensor([[-1.0, 0.0, 0.5, 2.0], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 0.0]])
    scale, zero = choose_qparams(w, QuantConfig(bits=4, group_size=-1, symmetric=False))
    # asym: range [min(min,0), max(max,0)]: [-1,2] -> 3/15, zero round(1/0.2)=5; [0,4] -> 4/15, zero 0;
    # all-zero -> GPTQ's [-1,1] -> 2/15, zero round(1/scale): float32 2/15 rounds up, so 1/scale is just
    # under 7.5 and the zero is 7 (the same float32 arithmetic as GPTQ's find_params gives).
    assert torch.allclose(scale[:, 0], torch.tensor([3 / 15, 4 / 15, 2 / 15]))
    assert zero[:, 0].tolist() == [5, 0, 7]
    scale, zero = choose_qparams(w, QuantConfig(bits=4, group_size=-1, symmetric=True))
    # sym: [-amax, amax] -> 2*amax/15 with zero at 2**(4-1) = 8; all-zero again [-1,1].
    assert torch.allclose(scale[:, 0], torch.tensor([4 / 15, 8 / 15, 2 / 15]))
    assert zero[:, 0].tolist() == [8, 8, 8]
    assert scale.dtype == torch.float32 and zero.dtype == torch.int32


@FAST
@given(weights_and_config())
def test_qparams_shapes_and_no_zero_scale(case):
    w, config = case
    scale, zero = choose_qparams(w, config)
    n_groups = config.n_groups(w.shape[1])
    assert scale.shape == zero.shape == (w.shape[0], n_groups)
    assert bool((scale > 0).all()) and bool(torch.isfinite(scale).all())
    assert int(zero.min()) >= 0 and int(zero.max()) <= config.maxq


def test_tiny_and_all_zero_groups_do_not_divide_by_zero():
    w = torch.zeros(3, 64)
    w[1, 5] = 1e-45  # a range whose scale underflows float32
    w[2, :] = -1e-30
    for sym in (False, True):
        config = QuantConfig(bits=4, group_size=32, symmetric=sym)
        scale, zero = choose_qparams(w, config)
        d = dequantize(quantize(w, scale, zero, config), scale, zero, config)
        assert bool(torch.isfinite(d).all())
        assert bool(((w - d).abs() <= _per_element(scale, config, 64) * 0.5 + 1e-44).all())
        assert bool((d[0] == 0).all())  # zero stays exactly representable


# ------------------------------------------------------------------------------------ quantize/dequantize


def _assert_half_step_bound(w, config):
    scale, zero = choose_qparams(w, config)
    q = quantize(w, scale, zero, config)
    assert q.dtype == torch.uint8 and q.shape == w.shape
    assert int(q.max()) <= config.maxq
    d = dequantize(q, scale, zero, config)
    step = _per_element(scale, config, w.shape[1])
    # Half a step, plus float32 rounding of w/scale and of (q - zero)*scale.
    tol = step * (0.5 + 1e-4) + 1e-6 * w.abs()
    assert bool(((w - d).abs() <= tol).all()), float(((w - d).abs() - tol).max())
    return scale, d


@FAST
@given(weights_and_config(symmetric=False))
def test_asymmetric_round_trip_error_is_at_most_half_a_step(case):
    _assert_half_step_bound(*case)


@FAST
@given(weights_and_config(symmetric=True))
def test_symmetric_round_trip_error_is_at_most_amax_over_maxq(case):
    w, config = case
    scale, _ = _assert_half_step_bound(w, config)
    # Symmetric: scale = 2*amax/maxq, so half a step is amax/maxq. The top code is zero + 2**(bits-1) - 1,
    # which is amax - scale/2: the largest positive value sits exactly on the bound (clamped), never beyond.
    amax = w.abs().reshape(w.shape[0], scale.shape[1], -1).amax(-1)
    # (Ranges so small that the scale would be subnormal get the smallest normal scale instead.)
    normal = 2 * amax / config.maxq >= torch.finfo(torch.float32).tiny
    assert torch.allclose(scale[normal], 2 * amax[normal] / config.maxq, rtol=1e-6, atol=0)


@FAST
@given(data=st.data(), bits=BITS, sym=st.booleans())
def test_values_on_the_grid_are_fixed_points(data, bits, sym):
    config = QuantConfig(bits=bits, group_size=32, symmetric=sym)
    out, n_groups = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    q = torch.tensor(data.draw(arrays(np.uint8, (out, 32 * n_groups), elements=st.integers(0, config.maxq))))
    scale = torch.tensor(data.draw(arrays(np.float32, (out, n_groups),
                                          elements=st.floats(2.0**-13, 2.0**7, width=32))))
    if sym:
        zero = torch.full((out, n_groups), 2 ** (bits - 1), dtype=torch.int32)
    else:
        zero = torch.tensor(data.draw(arrays(np.int32, (out, n_groups), elements=st.integers(0, config.maxq))))
    x = dequantize(q, scale, zero, config)
    assert torch.equal(quantize(x, scale, zero, config), q)
    assert torch.equal(dequantize(quantize(x, scale, zero, config), scale, zero, config), x)


@pytest.mark.parametrize("in_features", [32, 64, 128])
@pytest.mark.parametrize("sym", [False, True])
def test_per_channel_equals_one_group_of_the_full_width(in_features, sym):
    w = torch.randn(5, in_features, generator=torch.Generator().manual_seed(in_features))
    per_channel, whole = QuantConfig(4, -1, sym), QuantConfig(4, in_features, sym)
    s1, z1 = choose_qparams(w, per_channel)
    s2, z2 = choose_qparams(w, whole)
    assert torch.equal(s1, s2) and torch.equal(z1, z2) and s1.shape == (5, 1)
    assert torch.equal(quantize(w, s1, z1, per_channel), quantize(w, s2, z2, whole))


def test_per_channel_accepts_any_width_and_dequantize_honours_dtype():
    config = QuantConfig(bits=8, group_size=-1, symmetric=False)
    w = torch.randn(3, 96, dtype=torch.bfloat16)
    scale, zero = choose_qparams(w, config)
    d = dequantize(quantize(w, scale, zero, config), scale, zero, config, dtype=torch.bfloat16)
    assert d.dtype == torch.bfloat16 and d.shape == (3, 96)


def test_mismatched_qparams_or_out_of_range_codes_raise():
    config = QuantConfig(bits=4, group_size=32)
    w = torch.randn(2, 64)
    scale, zero = choose_qparams(w, config)
    with pytest.raises(ValueError, match="shape"):
        quantize(w, scale[:, :1], zero[:, :1], config)
    with pytest.raises(ValueError, match="scale must be positive"):
        quantize(w, torch.zeros_like(scale), zero, config)
    with pytest.raises(ValueError, match=r"codes must lie in \[0, 15\]"):
        dequantize(torch.full((2, 64), 16, dtype=torch.uint8), scale, zero, config)


# ------------------------------------------------------------------------------------------- int4 rows


def test_pack_int4_rows_hand_example():
    # Low nibble first: byte0 = code0 | code1<<4 = 0x1 | 0x2<<4 = 0x21; byte1 = 0x3 | 0xF<<4 = 0xF3.
    q = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    assert pack_int4_rows(q).tolist() == [[0x21, 0xF3]]


@FAST
@given(arrays(np.uint8, st.tuples(st.integers(1, 4), st.integers(1, 16).map(lambda n: 2 * n)),
              elements=st.integers(0, 15)))
def test_int4_rows_round_trip(codes):
    q = torch.from_numpy(codes)
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.uint8 and packed.shape == (q.shape[0], q.shape[1] // 2)
    assert torch.equal(unpack_int4_rows(packed), q)


def test_pack_int4_rows_rejects_odd_width_and_wide_codes():
    with pytest.raises(ValueError, match="even"):
        pack_int4_rows(torch.zeros(1, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="codes must lie"):
        pack_int4_rows(torch.full((1, 2), 16, dtype=torch.uint8))


# ------------------------------------------------------------------------------------------ GPTQ format


def _as_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _autogptq_pack_column(codes: list[int], bits: int) -> list[int]:
    """An independent oracle: AutoGPTQ QuantLinear.pack's word loop, restated step by step for one column."""
    words, i = [], 0
    while i < len(codes):
        if bits in (2, 4, 8):
            word = 0
            for j in range(32 // bits):
                word |= codes[i + j] << (bits * j)
            words.append(word)
            i += 32 // bits
            continue
        # 3 bits: 32 codes -> 3 words; codes 10 and 21 of the block straddle word boundaries.
        w0 = w1 = w2 = 0
        for j in range(10):
            w0 |= codes[i + j] << (3 * j)
        w0 |= (codes[i + 10] << 30) & 0xFFFFFFFF  # low 2 bits of code 10
        w1 |= (codes[i + 10] >> 2) & 1  # its top bit
        for j in range(10):
            w1 |= codes[i + 11 + j] << (3 * j + 1)
        w1 |= (codes[i + 21] << 31) & 0xFFFFFFFF  # low bit of code 21
        w2 |= (codes[i + 21] >> 1) & 3  # its top 2 bits
        for j in range(10):
            w2 |= codes[i + 22 + j] << (3 * j + 2)
        words += [w0, w1, w2]
        i += 32
    return [_as_int32(w) for w in words]


def test_gptq_4bit_hand_example():
    # in=8, out=8, one group (group_size=-1), symmetric 4-bit so every zero is 8.
    # q[o, i] = (o + i) % 16. Column o of qweight is row o packed along inputs, input i in bits 4i..4i+3:
    #   o=0: codes 0..7 -> 0x76543210;  o=1: codes 1..8 -> 0x87654321, whose top bit is set, so as int32 it is
    #   0x87654321 - 2**32. qzeros stores zero-1 = 7 for each of the 8 outputs along one word: 0x77777777.
    config = QuantConfig(bits=4, group_size=-1, symmetric=True)
    q = torch.tensor([[(o + i) % 16 for i in range(8)] for o in range(8)], dtype=torch.uint8)
    zero = torch.full((8, 1), 8, dtype=torch.int32)
    qweight, qzeros = pack_gptq(q, zero, config)
    assert qweight.dtype == qzeros.dtype == torch.int32
    assert qweight.shape == (1, 8) and qzeros.shape == (1, 1)
    assert qweight[0, 0].item() == 0x76543210
    assert qweight[0, 1].item() == 0x87654321 - 2 ** 32
    assert qzeros.tolist() == [[0x77777777]]


def test_gptq_2bit_hand_example():
    # in=16, out=16, 2 bits: 16 codes per word. Row 0 has code 3 at input 0 and code 1 at input 15 ->
    # 3 | 1 << 30 = 0x40000003; other rows are all 0. Zeros 2 (= 2**(2-1)) store 1 in each 2-bit field: 0x55555555.
    config = QuantConfig(bits=2, group_size=-1, symmetric=True)
    q = torch.zeros(16, 16, dtype=torch.uint8)
    q[0, 0], q[0, 15] = 3, 1
    qweight, qzeros = pack_gptq(q, torch.full((16, 1), 2, dtype=torch.int32), config)
    assert qweight.shape == (1, 16) and qweight[0].tolist() == [0x40000003] + [0] * 15
    assert qzeros.tolist() == [[0x55555555]]


def test_gptq_3bit_hand_example_straddles_word_boundaries():
    # in=32, out=32, 3 bits: 32 inputs fill 3 words (96 bits), code k at stream bits 3k..3k+2.
    # Row 0: code 10 = 0b111 sits at bits 30..32 -> word0 bits 30,31 (0xC0000000) and word1 bit 0 (1).
    # Row 1: code 21 = 0b101 sits at bits 63..65 -> word1 bit 31 (its low bit 1: 0x80000000), word2 bits 0..1
    # get its top bits 0b10 = 2. Zeros 4 store 3 = 0b011 in every field; out=32 zeros fill 3 words likewise.
    config = QuantConfig(bits=3, group_size=-1, symmetric=True)
    q = torch.zeros(32, 32, dtype=torch.uint8)
    q[0, 10], q[1, 21] = 0b111, 0b101
    qweight, qzeros = pack_gptq(q, torch.full((32, 1), 4, dtype=torch.int32), config)
    assert qweight.shape == (3, 32) and qzeros.shape == (1, 3)
    assert qweight[:, 0].tolist() == [_as_int32(0xC0000000), 1, 0]
    assert qweight[:, 1].tolist() == [0, _as_int32(0x80000000), 2]
    assert bool((qweight[:, 2:] == 0).all())
    # Stream of 32 fields of 0b011: word0 = ten fields + low 2 bits (0b11) of field 10 at bits 30-31.
    stream = sum(3 << (3 * k) for k in range(32))
    assert qzeros[0].tolist() == [_as_int32((stream >> (32 * w)) & 0xFFFFFFFF) for w in range(3)]
    assert qzeros[0, 0].item() == _as_int32(0xC0000000 | sum(3 << (3 * k) for k in range(10)))


@st.composite
def gptq_cases(draw):
    bits = draw(BITS)
    sym = draw(st.booleans())
    config = QuantConfig(bits=bits, group_size=draw(st.sampled_from([32, 64, -1])), symmetric=sym)
    in_features = draw(st.sampled_from([64, 128]))
    out = draw(st.sampled_from([32, 64]))  # multiples of 32 fit every bit width
    n_groups = config.n_groups(in_features)
    q = draw(arrays(np.uint8, (out, in_features), elements=st.integers(0, config.maxq)))
    low = 2 ** (bits - 1) if sym else 1
    high = 2 ** (bits - 1) if sym else config.maxq
    zero = draw(arrays(np.int32, (out, n_groups), elements=st.integers(low, high)))
    return torch.from_numpy(q), torch.from_numpy(zero), config


@FAST
@given(gptq_cases())
def test_gptq_pack_round_trips_and_matches_autogptq_layout(case):
    q, zero, config = case
    out, in_features = q.shape
    qweight, qzeros = pack_gptq(q, zero, config)
    bits, n_groups = config.bits, config.n_groups(in_features)
    assert qweight.shape == (in_features * bits // 32, out) and qweight.dtype == torch.int32
    assert qzeros.shape == (n_groups, out * bits // 32) and qzeros.dtype == torch.int32
    q2, zero2 = unpack_gptq(qweight, qzeros, config, in_features, out)
    assert torch.equal(q2, q) and torch.equal(zero2, zero) and q2.dtype == torch.uint8
    for o in (0, out - 1):  # qweight columns = rows of q packed along inputs
        assert qweight[:, o].tolist() == _autogptq_pack_column(q[o].tolist(), bits)
    for g in range(n_groups):  # qzeros rows = zero-1 of every output, packed along outputs
        assert qzeros[g].tolist() == _autogptq_pack_column((zero[:, g] - 1).tolist(), bits)


def test_gptq_zero_point_zero_is_refused_unless_wrapping_is_allowed():
    config = QuantConfig(bits=4, group_size=-1, symmetric=False)
    q = torch.zeros(8, 8, dtype=torch.uint8)
    zero = torch.zeros(8, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="zero point is 0"):
        pack_gptq(q, zero, config)
    qweight, qzeros = pack_gptq(q, zero, config, allow_zero_point_wrap=True)
    assert qzeros.tolist() == [[_as_int32(0xFFFFFFFF)]]  # 0 - 1 wraps to 15 in every field
    assert torch.equal(unpack_gptq(qweight, qzeros, config, 8, 8)[1], zero)  # masked +1 gives 0 back


def test_gptq_shapes_that_do_not_pack_raise():
    config = QuantConfig(bits=3, group_size=-1)
    with pytest.raises(ValueError, match="in_features=16 is not a multiple of 32"):
        pack_gptq(torch.zeros(32, 16, dtype=torch.uint8), torch.full((32, 1), 4, dtype=torch.int32), config)
    with pytest.raises(ValueError, match="out_features=8 is not a multiple of 32"):
        pack_gptq(torch.zeros(8, 32, dtype=torch.uint8), torch.full((8, 1), 4, dtype=torch.int32), config)
    with pytest.raises(ValueError, match="expected qweight"):
        unpack_gptq(torch.zeros(2, 32, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32), config, 32, 32)


def test_gptq_end_to_end_scales_and_g_idx():
    # The real export path: fp16 scales, codes made against those same scales, trivial g_idx.
    config = QuantConfig(bits=4, group_size=32, symmetric=True)
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    scale, zero = choose_qparams(w, config)
    scale = scale.half().float()
    q = quantize(w, scale, zero, config)
    qweight, qzeros = pack_gptq(q, zero, config)
    scales, g_idx = gptq_scales(scale), gptq_g_idx(64, config)
    assert scales.dtype == torch.float16 and scales.shape == (2, 16)
    assert g_idx.dtype == torch.int32 and g_idx.tolist() == [0] * 32 + [1] * 32
    q2, zero2 = unpack_gptq(qweight, qzeros, config, 64, 16)
    # Dequantize as a GPTQ kernel does: scales[g_idx] * (q - zero[g_idx]), here with the packed tensors.
    rebuilt = (q2.float() - zero2.float()[:, g_idx.long()]) * scales.float().t()[:, g_idx.long()]
    assert torch.equal(rebuilt, dequantize(q, scale, zero, config))


def _norm_error(w, scale, zero, config, norm=2.4):
    return (dequantize(quantize(w, scale, zero, config), scale, zero, config) - w).abs().pow(norm)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("gs", [32, 64, -1])  # 80 columns: 32 and 64 end in a ragged group of 16
def test_search_qparams_never_rounds_worse_than_min_max(bits, symmetric, gs):
    torch.manual_seed(bits)
    w = torch.randn(24, 80) * 0.05
    w[::5, 3] *= 20  # outliers: the groups where shrinking the range pays
    config = QuantConfig(bits=bits, group_size=gs, symmetric=symmetric)
    plain = choose_qparams(w, config)
    searched = search_qparams(w, config)
    assert searched[0].shape == plain[0].shape and searched[1].dtype == torch.int32
    assert bool((searched[0] > 0).all()) and bool((searched[1] >= 0).all() & (searched[1] <= config.maxq).all())
    # per group, in the search's own norm: never worse, and strictly better somewhere (at <= 4 bits)
    ng = config.n_groups(80)
    gsz = config.resolve_group_size(80)

    def per_group(err):
        padded = torch.nn.functional.pad(err, (0, ng * gsz - 80))
        return padded.reshape(24, ng, gsz).sum(-1)

    a, b = per_group(_norm_error(w, *plain, config)), per_group(_norm_error(w, *searched, config))
    assert bool((b <= a * (1 + 1e-6) + 1e-12).all())
    if bits <= 4:
        assert bool((b < a * 0.999).any())
        assert bool((searched[0] < plain[0]).any())  # a shrunk range: a finer grid
    if symmetric:
        assert bool((searched[1] == 1 << (bits - 1)).all())


def test_search_qparams_bad_arguments():
    config = QuantConfig(bits=4, group_size=32)
    for kwargs in ({"grid": 0}, {"max_shrink": 1.0}, {"max_shrink": 0.0}, {"norm": 0.0}):
        with pytest.raises(ValueError):
            search_qparams(torch.randn(4, 32), config, **kwargs)
