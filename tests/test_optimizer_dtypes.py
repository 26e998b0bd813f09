"""``ruda_torch.AdamW(fused_step=True)`` on every parameter torch's fused AdamW takes:
FP16/BF16 (with and without master weights, stochastic rounding), FP64, non-contiguous
and non-dense parameters, a Tensor lr, meta parameters at construction, and their
checkpoints, side by side with torch.optim.AdamW doing the same calls."""

from __future__ import annotations

import io

import pytest
import torch
from optim_harness import (
    TORCH_DEFAULTS,
    VS_TORCH,
    assert_bitwise,
    assert_bitwise_twins,
    copy_grads,
)
from tolerances import TOLERANCES
from torch import nn

import ruda_torch

HALF = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]
SHAPES = [(97,), (33, 31), (0,), (1025,), (4, 3, 5)]


def _params(dtype, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _grads(step: int, shapes=SHAPES):
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=gen) * 0.3 for s in shapes]


def _set_grads(params, step, dtype=None):
    """The step's gradients, rounded to ``dtype`` first when given (the values a 16-bit
    run sees, for its FP32 reference run)."""
    for p, g in zip(params, _grads(step, [tuple(p.shape) for p in params]), strict=True):
        p.grad = g.to(dtype or p.dtype).to(p.dtype)


# --------------------------------------------------------------------- 16-bit parameters


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_16bit_params_step_like_torch_in_fp32_rounded_each_step(dtype, amsgrad):
    """Without master weights, each step is torch's FP32 step from the parameter widened,
    rounded to the parameter's dtype (FP32 moments). The two FP32 steps differ by a few
    FP32 ulps (Note [Optimizer-level tolerance]), which changes the rounded value only
    where the FP32 result lies within those ulps of a rounding boundary: at most one
    16-bit ulp, on a small fraction of the elements."""
    ours_p = _params(dtype)
    ref_p = [nn.Parameter(p.detach().float()) for p in ours_p]
    ours = ruda_torch.AdamW(ours_p, **TORCH_DEFAULTS, amsgrad=amsgrad, fused_step=True)
    theirs = torch.optim.AdamW(ref_p, **TORCH_DEFAULTS, amsgrad=amsgrad, foreach=False)
    for step in range(1, 9):
        _set_grads(ours_p, step)
        _set_grads(ref_p, step, dtype)  # the same 16-bit values, widened
        ours.step()
        theirs.step()
        with torch.no_grad():
            for r in ref_p:
                r.copy_(r.to(dtype).float())
    differ = total = 0
    for a, r in zip(ours_p, ref_p, strict=True):
        r16 = r.detach().to(dtype)
        row = "bf16" if dtype == torch.bfloat16 else "fp16"
        rtol = TOLERANCES[f"{row}_params_vs_torch_fp32_rounded"].rtol
        ulp = (r16.float().abs() * rtol).clamp_min(1e-30)
        assert bool(((a.float() - r16.float()).abs() <= ulp).all())
        differ += int((a != r16).sum())
        total += a.numel()
        assert ours.state[a]["exp_avg"].dtype == torch.float32
    assert differ <= 0.02 * total, f"{differ} of {total} elements differ"


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_master_weights_follow_torch_fp32_and_the_param_is_the_master_rounded(dtype):
    ours_p = _params(dtype)
    masters = [nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(0)))
               for s in SHAPES]  # fmt: skip
    with torch.no_grad():
        for p, m in zip(ours_p, masters, strict=True):
            p.copy_(m.to(dtype))
            m.copy_(p.float())  # torch's FP32 run starts where ours does
    ours = ruda_torch.AdamW(ours_p, **TORCH_DEFAULTS, fused_step=True, master_weights=True)
    theirs = torch.optim.AdamW(masters, **TORCH_DEFAULTS, foreach=False)
    for step in range(1, 9):
        _set_grads(ours_p, step)
        _set_grads(masters, step, dtype)
        ours.step()
        theirs.step()
    for p, m in zip(ours_p, masters, strict=True):
        master = ours.state[p]["master_param"]
        assert master.dtype == torch.float32 and master.shape == p.shape
        VS_TORCH.check(master, m, "master vs torch's FP32 parameter")
        assert_bitwise(p, master.to(dtype), "the parameter is the master rounded")


def test_options_that_exclude_each_other_are_rejected():
    p = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="master_weights=True and stochastic_rounding=True"):
        ruda_torch.AdamW([p], fused_step=True, master_weights=True, stochastic_rounding=True)
    with pytest.raises(ValueError, match="require fused_step=True"):
        ruda_torch.AdamW([p], master_weights=True)
    with pytest.raises(ValueError, match="stochastic_rounding=True is implemented for bfloat16"):
        ruda_torch.AdamW([p.detach().half().requires_grad_()], fused_step=True,
                         stochastic_rounding=True)  # fmt: skip
    with pytest.raises(ValueError, match="rounding_seed must be an int"):
        ruda_torch.AdamW([p], fused_step=True, stochastic_rounding=True, rounding_seed=1.5)


@pytest.mark.parametrize("key", ["master_weights", "stochastic_rounding", "flat_grads"])
@pytest.mark.parametrize("value", ["remainder", "yes", 1, None])
def test_flags_take_true_or_false_only(key, value):
    """A value that only tests true (a string, 1) is not taken as True, at construction,
    add_param_group and the step; the step refuses before any write. master_weights also
    takes "remainder" (tests/test_remainder.py), and only that string."""
    p = nn.Parameter(torch.randn(300, dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    if (key, value) == ("master_weights", "remainder"):
        value = "fp32"  # a string that is not one of its values
    msg = "must be True, False or 'remainder'" if key == "master_weights" else (
        f"{key} must be True or False")  # fmt: skip
    with pytest.raises(ValueError, match=msg):
        ruda_torch.AdamW([p], fused_step=True, **{key: value})
    opt = ruda_torch.AdamW([p], fused_step=True)
    q = nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=msg):
        opt.add_param_group({"params": [q], key: value})
    assert len(opt.param_groups) == 1
    opt.param_groups[0][key] = value
    before = p.detach().clone()
    with pytest.raises(ValueError, match=msg):
        opt.step()
    assert torch.equal(p, before) and not opt.state


def test_stochastic_rounding_is_reproducible_and_differs_from_nearest():
    def run(**kw):
        ps = _params(torch.bfloat16, seed=3)
        opt = ruda_torch.AdamW(ps, **TORCH_DEFAULTS, fused_step=True, **kw)
        for step in range(1, 6):
            _set_grads(ps, step)
            opt.step()
        return ps

    a, b = run(stochastic_rounding=True, rounding_seed=7), run(stochastic_rounding=True,
                                                               rounding_seed=7)  # fmt: skip
    for x, y in zip(a, b, strict=True):
        assert_bitwise(x, y, "same seed")
    c = run(stochastic_rounding=True, rounding_seed=8)
    d = run()
    assert any(not torch.equal(x, y) for x, y in zip(a, c, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(a, d, strict=True))


def test_one_group_of_mixed_dtypes_is_one_bucket_per_dtype():
    gen = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.float64, torch.float16, torch.float32]
    ours_p = [nn.Parameter(torch.randn(65, generator=gen).to(d)) for d in dtypes]
    alone = [nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = ruda_torch.AdamW(ours_p, **TORCH_DEFAULTS, fused_step=True)
    singles = [ruda_torch.AdamW([p], **TORCH_DEFAULTS, fused_step=True) for p in alone]
    for step in range(1, 4):
        _set_grads(ours_p, step)
        _set_grads(alone, step)
        ours.step()
        for s in singles:
            s.step()
    assert len(ours._plan.buckets) == 4
    for p, q in zip(ours_p, alone, strict=True):
        assert_bitwise(p, q, f"{p.dtype} parameter")


# ---------------------------------------------------------------------------------- FP64


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_float64_params_step_like_torch_in_float64(amsgrad):
    ours_p = _params(torch.float64)
    ref_p = [nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = ruda_torch.AdamW(ours_p, **TORCH_DEFAULTS, amsgrad=amsgrad, fused_step=True)
    theirs = torch.optim.AdamW(ref_p, **TORCH_DEFAULTS, amsgrad=amsgrad, foreach=False)
    for step in range(1, 11):
        _set_grads(ours_p, step)
        _set_grads(ref_p, step)
        ours.step()
        theirs.step()
    rtol = TOLERANCES["reference_vs_torch_float64"].rtol
    for a, b in zip(ours_p, ref_p, strict=True):
        assert ours.state[a]["exp_avg"].dtype == torch.float64
        scale = b.abs().max().item() if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=0, atol=rtol * scale)


# ------------------------------------------------------------------------- layouts


def _layouts():
    gen = torch.Generator().manual_seed(9)
    transposed = torch.randn(31, 33, generator=gen).t()
    channels_last = torch.randn(8, 5, 3, 3, generator=gen).to(memory_format=torch.channels_last)
    gapped = torch.randn(10, 5, 2, generator=gen)[..., 0]  # torch's contiguous=False case
    sliced = torch.randn(7, 40, generator=gen)[:, 3:30]
    return {"transposed": transposed, "channels_last": channels_last, "gapped": gapped,
            "sliced": sliced}  # fmt: skip


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("kind", list(_layouts()))
def test_non_contiguous_params_step_like_torch_and_like_contiguous_ones(kind, amsgrad):
    """A dense non-contiguous parameter keeps its layout in the state; one with gaps is
    stepped through a staging copy; either way the values are those of a contiguous
    twin, bit for bit, and torch's within Note [Optimizer-level tolerance]."""
    base = _layouts()[kind]
    ours_p = [nn.Parameter(base.clone(memory_format=torch.preserve_format)),
              nn.Parameter(torch.randn(97))]  # fmt: skip
    if kind in ("gapped", "sliced"):
        ours_p[0] = nn.Parameter(base)  # the view itself, with its gaps
    assert not ours_p[0].is_contiguous()
    twin_p = [nn.Parameter(p.detach().clone(memory_format=torch.contiguous_format)) for p in ours_p]
    ref_p = [nn.Parameter(p.detach().clone()) for p in ours_p]
    ours = ruda_torch.AdamW(ours_p, **TORCH_DEFAULTS, amsgrad=amsgrad, fused_step=True)
    twin = ruda_torch.AdamW(twin_p, **TORCH_DEFAULTS, amsgrad=amsgrad, fused_step=True)
    theirs = torch.optim.AdamW(ref_p, **TORCH_DEFAULTS, amsgrad=amsgrad, foreach=False)
    for step in range(1, 6):
        grads = _grads(step, [tuple(p.shape) for p in ours_p])
        for ps in (ours_p, twin_p, ref_p):
            for p, g in zip(ps, grads, strict=True):
                p.grad = torch.empty_like(p).copy_(g)  # autograd's layout: the parameter's
        ours.step()
        twin.step()
        theirs.step()
    for a, t, r in zip(ours_p, twin_p, ref_p, strict=True):
        assert_bitwise(a.detach().contiguous(), t.detach(), f"{kind}: vs a contiguous twin")
        VS_TORCH.check(a, r, f"{kind}: vs torch")
    st = ours.state[ours_p[0]]
    if kind in ("transposed", "channels_last"):
        assert st["exp_avg"].stride() == ours_p[0].stride(), "the state keeps the layout"
    assert_bitwise(st["exp_avg"].contiguous(), twin.state[twin_p[0]]["exp_avg"], "moments")


def test_state_of_a_transposed_param_loads_from_torch_and_back():
    base = _layouts()["transposed"]
    ours_p = [nn.Parameter(base.clone(memory_format=torch.preserve_format))]
    ref_p = [nn.Parameter(base.clone(memory_format=torch.preserve_format))]
    theirs = torch.optim.AdamW(ref_p, **TORCH_DEFAULTS)
    for step in range(1, 4):
        _set_grads(ref_p, step)
        theirs.step()
    with torch.no_grad():
        ours_p[0].copy_(ref_p[0])
    ours = ruda_torch.AdamW(ours_p, **TORCH_DEFAULTS, fused_step=True)
    ours.load_state_dict(theirs.state_dict())
    assert_bitwise(ours.state[ours_p[0]]["exp_avg"], theirs.state[ref_p[0]]["exp_avg"])
    for step in range(4, 7):
        _set_grads(ours_p, step)
        _set_grads(ref_p, step)
        ours.step()
        theirs.step()
    VS_TORCH.check(ours_p[0], ref_p[0], "after loading torch's state")


# ------------------------------------------------------------------------- Tensor lr


def _schedule_run(lr, make_sched, steps=30):
    ps = _params(torch.float32, seed=11)
    opt = ruda_torch.AdamW(ps, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                           fused_step=True)  # fmt: skip
    sched = make_sched(opt)
    for step in range(1, steps + 1):
        _set_grads(ps, step)
        opt.step()
        sched.step()
    return ps, opt


SCHEDULES = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=40),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=5, gamma=0.5),
}


@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_tensor_lr_under_a_schedule_gives_the_bits_of_float_lr(sched):
    """torch's schedulers write a Tensor lr in place (fill_): the kernel reads the new
    value at every step from memory."""
    # FP64, so that the values the scheduler writes are the Python floats it computes.
    a, oa = _schedule_run(torch.tensor(1e-3, dtype=torch.float64), SCHEDULES[sched])
    b, ob = _schedule_run(1e-3, SCHEDULES[sched])
    assert isinstance(oa.param_groups[0]["lr"], torch.Tensor)
    for x, y in zip(a, b, strict=True):
        assert_bitwise(x, y, f"{sched}: Tensor lr vs float lr")


def test_tensor_lr_rules_are_torchs():
    p = [nn.Parameter(torch.zeros(3))]
    for opt_cls, kw in ((torch.optim.AdamW, {}), (ruda_torch.AdamW, {"fused_step": True})):
        with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
            opt_cls(p, lr=torch.tensor([1e-3, 1e-3]), **kw)
        with pytest.raises(ValueError, match="Invalid learning rate"):
            opt_cls(p, lr=torch.tensor(-1e-3), **kw)
        opt_cls(p, lr=torch.tensor([1e-3]), **kw)  # one element, any shape
        with pytest.raises(ValueError, match="betas must be either both floats or both Tensors"):
            opt_cls(p, betas=(torch.tensor(0.9), 0.999), **kw)


def test_tensor_lr_in_state_dict_round_trips():
    a, oa = _schedule_run(torch.tensor(1e-3), SCHEDULES["StepLR"], steps=7)
    buf = io.BytesIO()
    torch.save(oa.state_dict(), buf)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    assert isinstance(sd["param_groups"][0]["lr"], torch.Tensor)
    fresh = ruda_torch.AdamW([nn.Parameter(p.detach().clone()) for p in a], lr=torch.tensor(1.0),
                             fused_step=True)  # fmt: skip
    fresh.load_state_dict(sd)
    assert float(fresh.param_groups[0]["lr"]) == float(oa.param_groups[0]["lr"])


# ------------------------------------------------------------------------------ meta


def test_meta_params_are_accepted_at_construction_and_stepped_once_materialized():
    """As torch's fused path: the optimizer may be built before the model is
    materialized; stepping meta parameters is a clear error; after an in-place
    materialization (to_empty with swapped parameters keeps the Parameter objects) and
    an initialization the optimizer steps like torch."""
    with torch.device("meta"):
        model = nn.Linear(5, 3)
    ours = ruda_torch.AdamW(model.parameters(), **TORCH_DEFAULTS, fused_step=True)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(RuntimeError, match="meta device.*materialize the model"):
        ours.step()
    params = list(model.parameters())
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device="cpu")
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    model.reset_parameters()
    ref = nn.Linear(5, 3)
    ref.load_state_dict(model.state_dict())
    theirs = torch.optim.AdamW(ref.parameters(), **TORCH_DEFAULTS, foreach=False)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        ours.zero_grad()
        model(x).square().sum().backward()
        copy_grads(model, ref)  # Note [Twins share gradients] in tests/optim_harness.py
        ours.step()
        theirs.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        VS_TORCH.check(a, b, "after materialization")


# ----------------------------------------------------------------------- checkpoints


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("master", [False, True], ids=["rounded", "master"])
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_16bit_resume_is_bit_identical(dtype, master):
    def make(ps):
        return ruda_torch.AdamW(ps, **TORCH_DEFAULTS, fused_step=True, master_weights=master)

    straight = _params(dtype, seed=4)
    o1 = make(straight)
    for step in range(1, 7):
        _set_grads(straight, step)
        o1.step()
    first = _params(dtype, seed=4)
    o2 = make(first)
    for step in range(1, 4):
        _set_grads(first, step)
        o2.step()
    model_sd = _roundtrip([p.detach().clone() for p in first])
    opt_sd = _roundtrip(o2.state_dict())
    if master:
        assert opt_sd["state"][0]["master_param"].dtype == torch.float32
    resumed = [nn.Parameter(t) for t in model_sd]
    o3 = make(resumed)
    o3.load_state_dict(opt_sd)
    for step in range(4, 7):
        _set_grads(resumed, step)
        o3.step()
    assert_bitwise_twins(o1, o3, "a resumed run vs a straight one")


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_16bit_checkpoints_load_both_ways_with_torch(dtype):
    """torch.optim.AdamW casts loaded state to the parameter's dtype and carries the
    unknown master_param along; ours loads torch's 16-bit checkpoint into FP32 moments
    and starts the master from the parameter."""
    ours_p, ref_p = _params(dtype, seed=6), _params(dtype, seed=6)
    ours = ruda_torch.AdamW(ours_p, **TORCH_DEFAULTS, fused_step=True, master_weights=True)
    theirs = torch.optim.AdamW(ref_p, **TORCH_DEFAULTS, fused=True)
    for step in range(1, 4):
        _set_grads(ours_p, step)
        _set_grads(ref_p, step)
        ours.step()
        theirs.step()
    into_torch = torch.optim.AdamW(_params(dtype, seed=6), **TORCH_DEFAULTS, fused=True)
    into_torch.load_state_dict(_roundtrip(ours.state_dict()))
    into_torch_p = [p for g in into_torch.param_groups for p in g["params"]]
    st = into_torch.state[into_torch_p[0]]
    assert st["exp_avg"].dtype == dtype and float(st["step"]) == 3.0
    _set_grads(into_torch_p, 4)
    into_torch.step()  # torch steps with what it loaded
    into_ours_p = [nn.Parameter(p.detach().clone()) for p in ref_p]
    into_ours = ruda_torch.AdamW(into_ours_p, **TORCH_DEFAULTS, fused_step=True,
                                 master_weights=True)  # fmt: skip
    into_ours.load_state_dict(_roundtrip(theirs.state_dict()))
    for p, q in zip(into_ours_p, ref_p, strict=True):
        st = into_ours.state[p]
        assert st["exp_avg"].dtype == torch.float32
        assert_bitwise(st["exp_avg"].to(dtype), theirs.state[q]["exp_avg"], "loaded moment")
        assert_bitwise(st["master_param"], p.detach().float(), "master from the parameter")
    _set_grads(into_ours_p, 4)
    into_ours.step()


def test_hierarchical_stats_rejects_float64_params_before_any_write():
    p = nn.Parameter(torch.randn(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="hierarchical_stats=True reads FP32, FP16 and BF16"):
        ruda_torch.AdamW([p], fused_step=True, hierarchical_stats=True)
    # A parameter made FP64 after construction: rejected by the step, nothing written.
    q = nn.Parameter(torch.randn(10))
    opt = ruda_torch.AdamW([q], fused_step=True, hierarchical_stats=True)
    q.data = q.data.double()
    q.grad = torch.randn(10, dtype=torch.float64)
    before = q.detach().clone()
    with pytest.raises(ValueError, match="param group 0 parameter 0 is float64"):
        opt.step()
    assert torch.equal(q, before) and len(opt.state) == 0
