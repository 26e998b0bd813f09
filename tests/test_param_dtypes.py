"""The fused kernel for FP16, BF16 and FP64 parameters (Note [Parameter dtypes] in
csrc/adamw_math.h), master weights (Note [Master weights] in ruda_torch/_fused.py) and
stochastic rounding, at the operator level.

A 16-bit update is defined as the FP32 update of the parameter widened (or of its
master) rounded to the parameter's dtype, so each 16-bit case is checked bit for bit
against the FP32 kernel (itself checked against torch and the FP64 reference in
test_ops.py) followed by torch's own round-to-nearest-even conversion. FP64 is checked
against torch.optim.AdamW in float64 and the FP64 reference.
"""

from __future__ import annotations

import pytest
import torch
from test_ops import same_bits, seed_of
from tolerances import TOLERANCES

from ruda_torch import ops
from ruda_torch.reference import adamw_reference

HALF = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]
SIZES = [0, 1, 97, 1025, 65537]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1)


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(seed_of(*parts))


class Flat:
    """One tensor as a one-parameter bucket: its state slices, step counter and slot."""

    def __init__(self, gen, n: int, amsgrad: bool, state_dtype=torch.float32, steps: float = 3):
        self.exp_avg = (torch.randn(n, generator=gen) * 0.1).to(state_dtype)
        self.exp_avg_sq = (torch.rand(n, generator=gen) * 0.01).to(state_dtype)
        self.max_exp_avg_sq = (
            self.exp_avg_sq * torch.empty(n, dtype=state_dtype).uniform_(0.5, 1.5, generator=gen)
            if amsgrad
            else None
        )
        self.steps = torch.tensor([float(steps)])
        self.slots = torch.zeros((1, 2), dtype=torch.int64)

    def clone(self) -> Flat:
        other = object.__new__(Flat)
        for k, v in vars(self).items():
            setattr(other, k, None if v is None else v.clone())
        return other

    def step(self, param, grad, **kwargs) -> None:
        ops.adamw_scaled_(
            [param], [grad], self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq, self.steps,
            self.slots, **{**HYPER, **kwargs},
        )  # fmt: skip

    def same(self, other: Flat) -> bool:
        return all(
            same_bits(getattr(self, k), getattr(other, k))
            for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "steps")
        )


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` one element past an aligned address (no wide accesses)."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = base[1:]
    view.copy_(t.reshape(-1))
    return view


# ----------------------------------------------------------------- rounding conversions


def _finite_fp32_values(gen, n: int) -> torch.Tensor:
    """Random bit patterns over every finite FP32 value, and the cases that decide a
    rounding: exact ties (even and odd), the FP16 overflow edge, subnormal boundaries,
    signed zeros."""
    bits = torch.randint(-(2**31), 2**31, (n,), generator=gen, dtype=torch.int64)
    x = bits.to(torch.int32).view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
    ties = (torch.randint(0, 2**15, (64,), generator=gen, dtype=torch.int32) << 16) | 0x8000
    edges = torch.tensor(
        [0.0, -0.0, 65504.0, 65519.996, 65520.0, -65520.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25,
         2.0**-14, 2.0**-14 * (1 - 2.0**-11), 3.0 * 2.0**-25, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11,
         3.0e38, -3.4028235e38, 1e-45],
        dtype=torch.float32,
    )  # fmt: skip
    return torch.cat([x, ties.view(torch.float32), edges])


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_rounding_is_torchs_round_to_nearest_even(dtype):
    """With lr = 0 the update leaves the master as it is and writes the parameter from
    it; the master is only taken where the parameter equals the master rounded by the
    kernel's own conversion, so a master that comes out unchanged proves that
    conversion equal to torch's, element by element."""
    gen = _gen("rounding", str(dtype))
    master = _finite_fp32_values(gen, 200_000)
    param = master.to(dtype)
    n = master.numel()
    state = Flat(gen, n, amsgrad=False)
    state.exp_avg.zero_()
    master_in = master.clone()
    state.step(param, torch.zeros(n, dtype=dtype), master=master, lr=0.0, eps=1.0)
    differs = (master.view(torch.int32) != master_in.view(torch.int32)).nonzero()
    assert differs.numel() == 0, f"conversion differs from torch for {master_in[differs[:5, 0]]}"
    assert same_bits(param, master.to(dtype))


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_nan_is_one_bit_pattern(dtype):
    """Note [Canonical NaN]: a NaN result is written as 0x7FFF whatever made it."""
    n = 97
    param = torch.randn(n).to(dtype)
    grad = torch.randn(n).to(dtype)
    grad[::3] = float("nan")
    state = Flat(_gen("nan", str(dtype)), n, amsgrad=False)
    state.step(param, grad)
    nan = torch.isnan(param)
    assert nan.sum() >= n // 3
    assert (param.view(torch.int16)[nan] == 0x7FFF).all()


# ------------------------------------------------------------ 16-bit parameter updates


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("maximize", [False, True], ids=["min", "max"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("grad_kind", ["own", "fp32"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_16bit_update_is_the_fp32_update_rounded(dtype, n, grad_kind, amsgrad, maximize, unaligned):
    gen = _gen("16bit", str(dtype), n, grad_kind, amsgrad, maximize, unaligned)
    param = torch.randn(n, generator=gen).to(dtype)
    grad = (torch.randn(n, generator=gen) * 0.3).to(dtype if grad_kind == "own" else torch.float32)
    if unaligned:
        param, grad = _unaligned(param), _unaligned(grad)
    state = Flat(gen, n, amsgrad)
    ref_state, ref_param = state.clone(), param.float()
    scale = torch.tensor([4.0])
    for _ in range(3):
        state.step(param, grad, maximize=maximize, grad_scale=scale)
        ref_state.step(ref_param, grad, maximize=maximize, grad_scale=scale)
        assert state.same(ref_state), "moments and counters are the FP32 kernel's"
        assert same_bits(param, ref_param.to(dtype)), "the FP32 result, rounded to nearest even"
        ref_param = param.float()  # the next step starts from the rounded parameter


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_master_weights_update_the_master_and_round_it(dtype, n, amsgrad):
    gen = _gen("master", str(dtype), n, amsgrad)
    master = torch.randn(n, generator=gen)
    param = master.to(dtype)
    state = Flat(gen, n, amsgrad)
    ref_state, ref_master = state.clone(), master.clone()
    for step in range(4):
        grad = (torch.randn(n, generator=gen) * 0.3).to(dtype)
        state.step(param, grad, master=master)
        ref_state.step(ref_master, grad)
        assert same_bits(master, ref_master), f"step {step}: the master is the FP32 update"
        assert same_bits(param, master.to(dtype)), f"step {step}: the parameter is it rounded"
        assert state.same(ref_state)
    # A small update moves the master by less than half a 16-bit ulp: the parameter stays
    # while the master accumulates (what master weights are for).
    if n:
        assert not same_bits(master, param.float())


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_a_parameter_written_outside_the_step_replaces_its_master(dtype):
    """Note [Master weights]: where the parameter no longer holds the master rounded (a
    load of model weights, p.data.copy_), the step starts from the parameter."""
    n = 1025
    gen = _gen("written", str(dtype))
    master = torch.randn(n, generator=gen)
    param = master.to(dtype)
    written = torch.zeros(n, dtype=torch.bool)
    written[::7] = True
    param[written] = torch.randn(int(written.sum()), generator=gen).to(dtype)
    grad = (torch.randn(n, generator=gen) * 0.3).to(dtype)
    state = Flat(gen, n, amsgrad=False)
    ref_state = state.clone()
    expected_in = torch.where(written, param.float(), master)
    state.step(param, grad, master=master)
    ref_state.step(expected_in, grad)
    assert same_bits(master, expected_in)
    assert same_bits(param, expected_in.to(dtype))


# --------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_picks_a_neighbour_without_bias_and_reproducibly():
    """p = 1, no gradient, lr * wd = 2^-10: every FP32 result is 1 - 2^-10, a quarter of
    a BF16 ulp (2^-8 below 1) above 1 - 2^-8. Nearest even gives 1 everywhere (a bias of
    2^-10); stochastic rounding gives 1 - 2^-8 with probability 1/4."""
    n = 65537
    kw = dict(lr=1.0, weight_decay=2.0**-10, eps=1.0, stochastic_rounding=True)

    def run(seed, steps=0):
        p = torch.ones(n, dtype=torch.bfloat16)
        state = Flat(_gen("sr"), n, amsgrad=False, steps=steps)
        state.exp_avg.zero_()
        state.step(p, torch.zeros(n, dtype=torch.bfloat16), seed=seed, **kw)
        return p

    p = run(seed=1)
    down = p == 1.0 - 2.0**-8
    assert bool(((p == 1.0) | down).all()), "only the two neighbours of the FP32 result"
    assert abs(down.float().mean().item() - 0.25) < 0.01  # 6 sigma: 0.0017 each
    assert same_bits(p, run(seed=1)), "same seed, same counter: same bits"
    assert not same_bits(p, run(seed=2)), "another seed draws other bits"
    assert not same_bits(p, run(seed=1, steps=7)), "each step draws new bits"
    # Seeds wrap to 64 bits: the same bits as their two's complement.
    assert same_bits(run(seed=2**64 - 1), run(seed=-1))
    nearest = torch.ones(n, dtype=torch.bfloat16)
    state = Flat(_gen("sr"), n, amsgrad=False)
    state.exp_avg.zero_()
    state.step(nearest, torch.zeros(n, dtype=torch.bfloat16), lr=1.0, weight_decay=2.0**-10,
               eps=1.0)  # fmt: skip
    assert bool((nearest == 1.0).all())


def test_stochastic_rounding_of_random_updates_brackets_the_fp32_result():
    n = 65537
    gen = _gen("sr-random")
    param = torch.randn(n, generator=gen).to(torch.bfloat16)
    grad = (torch.randn(n, generator=gen) * 0.3).to(torch.bfloat16)
    state = Flat(gen, n, amsgrad=True)
    ref_state, ref = state.clone(), param.float()
    state.step(param, grad, stochastic_rounding=True, seed=123)
    ref_state.step(ref, grad)
    assert state.same(ref_state)
    bits = ref.view(torch.int32)
    low = (bits >> 16).to(torch.int16)  # truncation toward zero
    high = ((bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)).to(torch.int16)
    got = param.view(torch.int16)
    assert bool(((got == low) | (got == high)).all())
    # Unbiased: the mean rounding error is far below the mean BF16 ulp.
    err = (param.double() - ref.double()) / (high.view(torch.bfloat16).double() -
                                             low.view(torch.bfloat16).double()).abs().clamp_min(1e-30)  # fmt: skip
    assert abs(err[(bits & 0xFFFF) != 0].mean().item()) < 0.02


# ----------------------------------------------------------------------------- FP64


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("n", SIZES)
def test_float64_update_is_fp64_math(n, amsgrad):
    """FP64 parameters, moments and gradients: the FP64 reference (docs/design.md section 1 in
    FP64) within the FP64-vs-FP64 row of the tolerance table."""
    gen = _gen("fp64", n, amsgrad)
    param = torch.randn(n, generator=gen, dtype=torch.float64)
    grad = torch.randn(n, generator=gen, dtype=torch.float64) * 0.3
    state = Flat(gen, n, amsgrad, state_dtype=torch.float64)
    ref_p, _, ref_v, _, _ = adamw_reference(
        param, grad, state.exp_avg, state.exp_avg_sq, state.max_exp_avg_sq, step=3,
        lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"], amsgrad=amsgrad,
    )  # fmt: skip
    state.step(param, grad)
    rtol = TOLERANCES["reference_vs_torch_float64"].rtol
    scale = ref_p.abs().max().item() if n else 1.0
    torch.testing.assert_close(param, ref_p, rtol=0, atol=rtol * scale)
    torch.testing.assert_close(state.exp_avg_sq, ref_v, rtol=rtol, atol=0)
    # FP32 arithmetic would be ~1e-8 away: this is FP64 math.
    if n:
        assert (param - ref_p).abs().max().item() < 1e-14 * max(scale, 1.0)


# ------------------------------------------------------------------------ Tensor lr


@pytest.mark.parametrize("lr_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_tensor_lr_gives_the_bits_of_the_float_lr(dtype, lr_dtype):
    gen = _gen("lr", str(dtype), str(lr_dtype))
    n = 1025
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    a = torch.randn(n, generator=gen).to(dtype)
    b = a.clone()
    grad = torch.randn(n, generator=gen).to(dtype)
    sa = Flat(gen, n, amsgrad=False, state_dtype=state_dtype)
    sb = sa.clone()
    lr = torch.tensor(3e-3, dtype=lr_dtype)
    sa.step(a, grad, lr=0.0, lr_tensor=lr)
    sb.step(b, grad, lr=float(lr))
    assert same_bits(a, b) and sa.same(sb)


# --------------------------------------------------------------------- dense layouts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_transposed_parameter_is_stepped_in_memory_order(dtype):
    """Note [Dense layouts]: state element k belongs to the parameter's k-th element in
    memory; a transposed parameter with its transposed gradient is the contiguous one
    with the state permuted alike."""
    gen = _gen("transposed", str(dtype))
    p = torch.randn(33, 31, generator=gen).to(dtype).t()
    g = torch.randn(33, 31, generator=gen).to(dtype).t()
    assert not p.is_contiguous()
    n = p.numel()
    state = Flat(gen, n, amsgrad=True)
    flat_state = state.clone()
    flat_p, flat_g = p.t().contiguous().reshape(-1), g.t().contiguous().reshape(-1)
    state.step(p, g)
    flat_state.step(flat_p, flat_g)
    assert same_bits(p.t().reshape(-1), flat_p) and state.same(flat_state)


def test_a_gradient_in_another_layout_is_rejected():
    p = torch.randn(8, 6).t()
    g = torch.randn(6, 8)
    with pytest.raises(RuntimeError, match=r"grads\[0\] must lay its elements out"):
        Flat(_gen("layout"), p.numel(), False).step(p, g)
