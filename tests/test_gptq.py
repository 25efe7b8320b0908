import warnings

import pytest
import torch

from toolkit.quant.gptq import HessianAccumulator, gptq_quantize
from toolkit.quant.model_quant import QuantRecipe
from toolkit.quant.primitives import QuantConfig, dequantize
from toolkit.quant.rtn import rtn_quantize

OUT, IN, N = 64, 256, 1024


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(IN, IN, generator=g) / IN ** 0.5
    x = torch.randn(N, IN, generator=g) @ a + 0.05 * torch.randn(N, IN, generator=g)  # correlated inputs
    x = x * torch.linspace(0.2, 3.0, IN)[torch.randperm(IN, generator=g)]  # uneven channel importance
    w = torch.randn(OUT, IN, generator=g) * 0.05
    return x, w


def _hessian(x):
    acc = HessianAccumulator()
    for chunk in x.reshape(4, -1, IN):  # batches of [tokens, in], some as 3-D
        acc.add(chunk.reshape(2, -1, IN))
    return acc


def _out_err(x, w, w_hat):
    return torch.linalg.norm(x @ w.t() - x @ w_hat.t()).item()


def test_hessian_accumulator_is_running_average():
    x, _ = _data()
    acc = _hessian(x)
    assert acc.samples == N
    torch.testing.assert_close(acc.hessian, 2 / N * x.t() @ x, rtol=1e-4, atol=1e-4)


def test_hessian_of_bf16_inputs_is_the_fp32_average_of_their_bf16_products():
    x, _ = _data()
    xb = x.to(torch.bfloat16)
    acc = _hessian(xb)
    assert acc.samples == N and acc.hessian.dtype == torch.float32
    exact = 2 / N * xb.float().t() @ xb.float()  # the same (bf16-rounded) inputs summed in fp32
    err = (acc.hessian - exact).abs().max() / exact.abs().max()
    assert 0 < err < 4e-3, err  # each batch's product rounded once to bf16 (2^-9), not more


@pytest.mark.parametrize("width", [513, 600])
def test_wide_bf16_hessian_from_three_half_blocks_equals_the_full_product(width):
    """From 512 features the bf16 Gram is built from the diagonal half-blocks and one off-diagonal block (its
    transpose fills the other): the full GEMM's values, exactly symmetric, over several batches."""
    g = torch.Generator().manual_seed(4)
    batches = [torch.randn(300, width, generator=g).to(torch.bfloat16) for _ in range(3)]
    acc = HessianAccumulator(width)
    expected = torch.zeros(width, width)
    for i, xb in enumerate(batches):
        acc.add(xb)
        expected.mul_(i / (i + 1)).add_((xb.t() @ xb).float(), alpha=2.0 / (300 * (i + 1)))
    assert torch.equal(acc.hessian, acc.hessian.t())
    torch.testing.assert_close(acc.hessian, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [QuantConfig(4, 32, True), QuantConfig(4, 32, False), QuantConfig(3, 128, True),
                                    QuantConfig(3, -1, False)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn(config, act_order):
    x, w = _data()
    h = _hessian(x).hessian
    qw, loss = gptq_quantize(w, h, config, act_order=act_order)
    rtn = rtn_quantize(w, config).dequantize()
    err_gptq, err_rtn = _out_err(x, w, qw.dequantize()), _out_err(x, w, rtn)
    assert err_gptq <= 0.8 * err_rtn, (err_gptq, err_rtn)
    assert qw.codes.dtype == torch.uint8 and int(qw.codes.max()) <= config.maxq
    assert qw.scale.shape == qw.zero.shape == (OUT, config.n_groups(IN)) and qw.zero.dtype == torch.int32
    assert int(qw.zero.min()) >= 0 and int(qw.zero.max()) <= config.maxq
    assert loss > 0


def test_act_order_g_idx_and_reconstruction():
    x, w = _data(1)
    h = _hessian(x).hessian
    config = QuantConfig(4, 32, True)
    qw, _ = gptq_quantize(w, h, config, act_order=True, block_size=48)  # blocks not aligned to groups
    perm = torch.argsort(torch.diag(h), descending=True)
    assert qw.g_idx.dtype == torch.int32 and qw.g_idx.shape == (IN,)
    assert torch.equal(qw.g_idx[perm].long(), torch.arange(IN) // 32)  # group of the quantization position
    direct = (qw.codes.float() - qw.zero[:, qw.g_idx.long()].float()) * qw.scale[:, qw.g_idx.long()]
    assert torch.equal(qw.dequantize(), direct)
    # permuting columns into quantization order gives an ordinary group-wise layout
    assert torch.equal(dequantize(qw.codes[:, perm], qw.scale, qw.zero, config), direct[:, perm])


def test_static_groups_act_order():
    x, w = _data(2)
    h = _hessian(x).hessian
    config = QuantConfig(4, 64, False)
    qw, _ = gptq_quantize(w, h, config, act_order=True, static_groups=True)
    assert torch.equal(qw.g_idx.long(), torch.arange(IN) // 64)
    assert torch.equal(qw.dequantize(), dequantize(qw.codes, qw.scale, qw.zero, config))
    assert _out_err(x, w, qw.dequantize()) <= 0.8 * _out_err(x, w, rtn_quantize(w, config).dequantize())
    qs, _ = gptq_quantize(w, h, config, static_groups=True)  # without act_order: plain layout, RTN's qparams
    assert qs.g_idx is None
    rtn = rtn_quantize(w, config)
    assert torch.equal(qs.scale, rtn.scale) and torch.equal(qs.zero, rtn.zero)


def test_loss_matches_quadratic_objective():
    x, w = _data(3)
    h = _hessian(x).hessian
    config = QuantConfig(4, 32, True)
    damp = 0.01
    qw, loss = gptq_quantize(w, h, config, damp_percent=damp, block_size=64)
    hd = h.double() + damp * torch.mean(torch.diag(h)).double() * torch.eye(IN, dtype=torch.float64)
    delta = (w - qw.dequantize()).double()
    expected = 0.5 * torch.einsum("oi,ij,oj->", delta, hd, delta).item()
    assert loss == pytest.approx(expected, rel=2e-3)


def test_dead_column():
    x, w = _data(4)
    x[:, [5, 100]] = 0
    h = _hessian(x).hessian
    assert h[5, 5] == 0
    for act_order in (False, True):
        qw, loss = gptq_quantize(w, h, QuantConfig(4, 32, True), act_order=act_order)
        wq = qw.dequantize()
        assert torch.isfinite(wq).all() and torch.isfinite(torch.tensor(loss))
        assert (wq[:, [5, 100]] == 0).all()


def test_not_positive_definite_raises_damping():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(16, IN, generator=g)  # rank 16 < 256
    h = 2 / 16 * x.t() @ x
    h -= 1e-3 * torch.mean(torch.diag(h)) * torch.eye(IN)  # slightly negative eigenvalues
    w = torch.randn(OUT, IN, generator=g)
    with pytest.warns(RuntimeWarning, match="damp_percent=0.01"):
        qw, loss = gptq_quantize(w, h, QuantConfig(4, 128, True), damp_percent=0.0)
    assert torch.isfinite(qw.dequantize()).all() and loss >= 0
    bad = -torch.eye(IN)
    with pytest.raises(RuntimeError, match="not positive definite"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gptq_quantize(w, bad, QuantConfig(4, 128, True))


def test_8bit_per_channel_and_bias():
    x, w = _data(6)
    h = _hessian(x).hessian
    config = QuantConfig(8, -1, False)
    bias = torch.randn(OUT)
    qw, _ = gptq_quantize(w, h, config, bias=bias)
    assert qw.scale.shape == (OUT, 1) and qw.g_idx is None
    assert torch.equal(qw.bias, bias) and qw.bias is not bias
    err = _out_err(x, w, qw.dequantize())
    assert err <= _out_err(x, w, rtn_quantize(w, config).dequantize())
    assert err < 0.01 * torch.linalg.norm(x @ w.t()).item()


def test_bad_arguments():
    w = torch.randn(8, 64)
    with pytest.raises(ValueError, match="hessian"):
        gptq_quantize(w, torch.eye(32), QuantConfig(4, 32))


@pytest.mark.parametrize("act_order,static_groups", [(False, False), (True, False), (True, True)])
def test_gptq_with_a_ragged_last_group_beats_rtn(act_order, static_groups):
    """160 inputs at group 64: groups of 64, 64 and 32 (SmolLM2's 576 at 128 has the same shape of problem)."""
    x, w = _data(3)
    x, w = x[:, :160], w[:, :160]
    config = QuantConfig(4, 64, False)
    qw, _ = gptq_quantize(w, 2 / N * x.t() @ x, config, act_order=act_order, static_groups=static_groups,
                          block_size=48)  # blocks not aligned to the groups, and the last block ragged too
    assert qw.scale.shape == qw.zero.shape == (OUT, 3) and qw.codes.shape == (OUT, 160)
    if qw.g_idx is not None:
        assert int(qw.g_idx.max()) == 2 and int((qw.g_idx == 2).sum()) == 32
    err_gptq = _out_err(x, w, qw.dequantize())
    err_rtn = _out_err(x, w, rtn_quantize(w, config).dequantize())
    assert err_gptq <= 0.8 * err_rtn, (err_gptq, err_rtn)


def test_mse_option_takes_each_groups_range_from_the_search():
    from toolkit.quant.primitives import choose_qparams, search_qparams

    x, w = _data(3)
    w[::7, 11] *= 25  # outliers: ranges the search shrinks
    h = _hessian(x).hessian
    config = QuantConfig(bits=4, group_size=32, symmetric=False)
    # up-front qparams (static groups): exactly the search's on the original weight
    qw, _ = gptq_quantize(w, h, config, static_groups=True, mse=True)
    expected = search_qparams(w, config)
    assert torch.equal(qw.scale, expected[0]) and torch.equal(qw.zero, expected[1])
    assert not torch.equal(expected[0], choose_qparams(w, config)[0])
    # qparams chosen as each group starts: different from min/max ones, and still GPTQ (beats RTN with the search)
    plain, _ = gptq_quantize(w, h, config)
    searched, _ = gptq_quantize(w, h, config, mse=True)
    assert not torch.equal(plain.scale, searched.scale)
    rtn = rtn_quantize(w, config, mse=True)
    assert torch.equal(rtn.scale, expected[0]) and torch.equal(rtn.zero, expected[1])
    assert _out_err(x, w, searched.dequantize()) < 0.9 * _out_err(x, w, rtn.dequantize())


# ------------------------------------------------------------------------ GPTAQ (asymmetric calibration)

def _asymmetric_data(seed=1):
    """Float-model inputs x̃ and the inputs x the layer really gets after quantized layers before it: x̃ plus a
    correlated drift (what earlier layers' rounding does), as in GPTAQ's setting."""
    x_float, w = _data(seed)
    g = torch.Generator().manual_seed(seed + 100)
    drift = x_float @ (0.15 * torch.randn(IN, IN, generator=g) / IN ** 0.5) + 0.05 * torch.randn(N, IN, generator=g)
    return x_float, x_float + drift, w


def test_accumulator_averages_the_asymmetric_cross_term_in_the_order_of_the_inputs():
    x_float, x, _ = _asymmetric_data()
    acc = HessianAccumulator(IN, float_inputs=x_float.reshape(2, N // 2, IN))  # any leading shape
    for chunk in x.split(N // 4):
        acc.add(chunk.reshape(2, -1, IN))
    torch.testing.assert_close(acc.hessian, 2 / N * x.t() @ x, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(acc.delta_xxt, 2 / N * (x_float - x).t() @ x, rtol=1e-4, atol=1e-4)
    assert HessianAccumulator(IN).delta_xxt is None  # plain GPTQ keeps no cross term
    with pytest.raises(ValueError, match="more inputs"):
        acc.add(x[:1])


def test_gptaq_fits_the_float_models_outputs_better_than_gptq():
    """GPTAQ's objective |W x̃ - Q x|: the quantized layer, fed the drifted inputs, lands nearer the FLOAT
    layer's outputs than plain GPTQ (which fits W x); alpha=0 (or no cross term) is plain GPTQ, code for code."""
    x_float, x, w = _asymmetric_data()
    acc = HessianAccumulator(IN, float_inputs=x_float)
    acc.add(x)
    config = QuantConfig(4, 32, False)
    plain, _ = gptq_quantize(w, acc.hessian, config)
    zero_alpha, _ = gptq_quantize(w, acc.hessian, config, delta_xxt=acc.delta_xxt, asym_alpha=0.0)
    assert torch.equal(plain.codes, zero_alpha.codes) and torch.equal(plain.scale, zero_alpha.scale)

    def float_err(qw):
        return torch.linalg.norm(x_float @ w.t() - x @ qw.dequantize().t()).item()

    errs = {a: float_err(gptq_quantize(w, acc.hessian, config, delta_xxt=acc.delta_xxt, asym_alpha=a)[0])
            for a in (0.25, 0.5, 1.0)}
    assert all(e < float_err(plain) for e in errs.values()), (errs, float_err(plain))
    assert errs[1.0] < 0.8 * float_err(plain), (errs, float_err(plain))


def test_gptaq_target_is_the_least_squares_weight():
    """With alpha=1 and no damping, the weight GPTAQ quantizes is argmin |W x̃ - W* x|: W* = W (x̃ᵀx)(xᵀx)⁻¹."""
    from toolkit.quant.gptq import _asymmetric_shift

    x_float, x, w = _asymmetric_data()
    x_float, x, w = x_float.double(), x.double(), w.double()
    h, delta = 2 / N * x.t() @ x, 2 / N * (x_float - x).t() @ x
    target = w + _asymmetric_shift(w, h, delta, torch.zeros(IN, dtype=torch.bool), damp_percent=0.0)
    lstsq = torch.linalg.lstsq(x, x_float @ w.t()).solution.t()
    torch.testing.assert_close(target, lstsq, rtol=1e-6, atol=1e-8)


def test_gptaq_step_is_damped_as_gptqs_own_solve_where_h_is_not_positive_definite():
    """An indefinite H (bf16 products can make one: SmolLM2's and Gemma 3's first blocks) gets its damping raised
    x10 until it factors, for the GPTAQ step as for GPTQ's own solve."""
    from toolkit.quant.gptq import _asymmetric_shift

    x_float, x, w = _asymmetric_data()
    h, delta = 2 / N * x.t() @ x, 2 / N * (x_float - x).t() @ x
    mean_diag = float(torch.diag(h).mean())
    smallest = float(torch.linalg.eigvalsh(h)[0])
    h = h - (smallest + 0.05 * mean_diag) * torch.eye(IN)  # not positive definite at 1% damping; it is at 10%
    shift = _asymmetric_shift(w, h, delta, torch.zeros(IN, dtype=torch.bool), damp_percent=0.01)
    damped = h + 0.1 * float(torch.diag(h).mean()) * torch.eye(IN)
    torch.testing.assert_close(shift, torch.linalg.solve(damped, (w @ delta).t()).t(), rtol=1e-3, atol=1e-5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qw, _ = gptq_quantize(w, h, QuantConfig(4, 32, False), delta_xxt=delta, asym_alpha=1.0)
    assert caught and all("retrying with damp_percent=0.1" in str(w.message) for w in caught)
    assert torch.isfinite(qw.scale).all() and float(qw.dequantize().abs().max()) < 10 * float(w.abs().max())


def test_gptaq_step_over_its_bound_is_solved_again_with_more_damping_or_dropped():
    """`gptaq_max_step`: an input channel that barely varies in the calibration data but drifts (an attention
    output with a near-constant channel) makes H nearly singular there, and the least-squares step blows up
    along it. Over the bound the step is solved again with H's damping raised x10 (warned, the bound then
    held); a bound no damping meets drops the step (plain GPTQ's codes, warned); a step within the bound is the
    unbounded step exactly (a normal layer is unchanged by the option)."""
    from toolkit.quant.gptq import _asymmetric_shift, _bounded_shift

    x_float, x, w = _asymmetric_data()
    no_dead = torch.zeros(IN, dtype=torch.bool)
    h, delta = 2 / N * x.t() @ x, 2 / N * (x_float - x).t() @ x
    normal = _asymmetric_shift(w, h, delta, no_dead, 0.01)
    ratio = float(normal.norm() / w.norm())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # within the bound: no warning, the same step
        assert torch.equal(_bounded_shift(w, h, delta, no_dead, 0.01, 1.0, 2 * ratio), normal)
        assert torch.equal(_bounded_shift(w, h, delta, no_dead, 0.01, 1.0, None), normal)

    z = torch.randn(N, generator=torch.Generator().manual_seed(5))
    x, x_float = x.clone(), x_float.clone()
    x[:, 3] = 1e-3 * z  # a channel that barely varies on the quantized path...
    x_float = x_float + 0.3 * z[:, None]  # ...while the float inputs move with it, in every channel
    h, delta = 2 / N * x.t() @ x, 2 / N * (x_float - x).t() @ x
    wild = _asymmetric_shift(w, h, delta, no_dead, 0.0)  # undamped: H's tiny direction amplified ~1e6-fold
    assert float(wild.norm() / w.norm()) > 1.0  # the blow-up the bound is for
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bounded = _bounded_shift(w, h, delta, no_dead, 0.0, 1.0, 0.25)
    assert float(bounded.norm() / w.norm()) <= 0.25
    assert len(caught) == 1 and "solved with damp_percent=" in str(caught[0].message)
    damp = float(str(caught[0].message).split("damp_percent=")[1].split()[0])
    assert damp >= 0.01
    torch.testing.assert_close(bounded, _asymmetric_shift(w, h, delta, no_dead, damp))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dropped, _ = gptq_quantize(w, h, QuantConfig(4, 32, False), delta_xxt=delta, asym_alpha=1.0,
                                   asym_max_step=1e-9)  # no damping gets a step under that
    assert any("quantized without it" in str(c.message) for c in caught)
    plain, _ = gptq_quantize(w, h, QuantConfig(4, 32, False))
    assert torch.equal(dropped.codes, plain.codes) and torch.equal(dropped.scale, plain.scale)
    with pytest.raises(ValueError, match="gptaq_max_step"):
        QuantRecipe(method="gptq", gptaq_alpha=0.5, gptaq_max_step=0)
