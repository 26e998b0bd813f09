"""ruda_torch.AdamW's gradient statistics and clipping (docs/design.md sections 2-4).

``hierarchical_stats=True`` computes one 12-byte report ``[sum_of_squares, max_abs,
nonfinite_count]`` of the unscaled gradients of every active parameter before any update;
it skips the whole step on a non-finite gradient and, with ``max_grad_norm``, clips like
``torch.nn.utils.clip_grad_norm_``. Compared here against clip_grad_norm_ +
torch.optim.AdamW (foreach=False, or fused=True under GradScaler) on the small model of
tests/optim_harness.py, and the report against FP64 sums of the gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from optim_harness import (
    CASES,
    MODE_IDS,
    TORCH_DEFAULTS,
    VS_TORCH_CLIPPED,
    Case,
    Net,
    assert_bitwise,
    assert_bitwise_twins,
    assert_matches_torch,
    assert_same_snapshot,
    backward,
    copy_grads,
    make_ours,
    make_torch,
    snapshot,
    twin,
)
from threads import num_threads
from torch import nn

import ruda_torch

STATS_CASES = [c for c in CASES if c.id in ("torch-defaults", "amsgrad", "two-groups")]
AMSGRAD = next(c for c in CASES if c.id == "amsgrad")
MAX_NORM = 1.0
# Gradient multipliers per step: the clip is active on some steps and not on others.
GRAD_SCALE = {1: 20.0, 2: 0.05, 3: 5.0, 4: 1.0, 5: 30.0, 6: 0.01, 7: 3.0, 8: 0.5}
# Note [Report tolerance]: the report sums FP32 squares in a fixed tree (per 4096-element
# row, then fan-in 1024); against the exact FP64 sum that is a relative error of a few
# FP32 ulps times log2 of the terms per partial sum: under 1e-6 for these few thousand
# elements (2e-6 is the brief's bound, ~17 ulps), and 1e-5 for millions of elements.
NORM_RTOL = 2e-6
INJECT_AT = {3: ("fc2.bias", math.inf), 6: ("fc1.weight", math.nan)}  # step -> (param, value)
NORM_RTOL_LARGE = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (see tests/test_optimizer.py; report bits do not depend on it,
    test_large_bucket_report checks that with 2 threads)."""
    with num_threads(1):
        yield


def _scaled_backward(model: Net, step: int) -> None:
    backward(model, step)
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(GRAD_SCALE[step])


def _fp64_stats(grads, scale: float = 1.0) -> tuple[float, float, int]:
    """(norm, max_abs, nonfinite count) of the unscaled gradients, exactly in FP64."""
    flat = torch.cat([g.detach().reshape(-1).double() for g in grads]) / scale
    finite = flat[torch.isfinite(flat)]
    sq = math.fsum((finite * finite).tolist())
    return (
        math.sqrt(sq),
        finite.abs().max().item() if finite.numel() else 0.0,
        flat.numel() - finite.numel(),
    )


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def _torch_clip(model: nn.Module, max_norm: float = MAX_NORM) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    return torch.nn.utils.clip_grad_norm_(params, max_norm).item()


def _scaler_steps(sc_o, sc_t, ours, theirs, mt) -> None:
    """One GradScaler step of both optimizers: torch's side unscales and clips first (ours
    does both inside its step), then both step and update; the scales must agree."""
    sc_t.scale(torch.zeros(()))
    sc_t.unscale_(theirs)
    _torch_clip(mt)
    sc_o.step(ours)
    sc_t.step(theirs)
    sc_o.update()
    sc_t.update()
    assert sc_o.get_scale() == sc_t.get_scale()


def _check_report(report, grads, *, max_norm, scale=1.0, rtol=NORM_RTOL, skipped=False):
    norm, max_abs, nonfinite = _fp64_stats(grads, scale)
    assert isinstance(report, ruda_torch.GradientReport)
    assert report.tensor.shape == (3,) and report.tensor.dtype == torch.float32
    for name in ("grad_norm", "max_abs", "nonfinite_count", "clip_coef", "skipped"):
        value = getattr(report, name)
        assert isinstance(value, torch.Tensor) and value.dim() == 0, name
    assert report.nonfinite_count.item() == nonfinite
    assert report.grad_norm.item() == pytest.approx(norm, rel=rtol, abs=1e-30)
    assert report.max_abs.item() == torch.tensor(max_abs, dtype=torch.float32).item()
    expected_coef = 1.0 if max_norm is None else min(1.0, max_norm / (norm + 1e-6))
    assert report.clip_coef.item() == pytest.approx(expected_coef, rel=rtol)
    assert bool(report.skipped) is skipped


# ------------------------------------------------------------------- clipping vs torch


@pytest.mark.parametrize("case", STATS_CASES, ids=[c.id for c in STATS_CASES])
def test_stats_clipping_like_torch(case):
    """hierarchical_stats + max_grad_norm against clip_grad_norm_(all params) +
    torch.optim.AdamW over 8 steps and two param groups; the report after every step."""
    mo = Net()
    mt = twin(mo)
    ours = make_ours(mo, case, "fused", hierarchical_stats=True, max_grad_norm=MAX_NORM)
    theirs = make_torch(mt, case)
    assert ours.last_report is None
    clipped = 0
    for step in range(1, 9):
        _scaled_backward(mo, step)
        copy_grads(mo, mt)
        grads = [g.clone() for g in _grads(mo)]
        total = _torch_clip(mt)
        clipped += total > MAX_NORM
        ours.step()
        theirs.step()
        _check_report(ours.last_report, grads, max_norm=MAX_NORM)
        assert ours.last_report.grad_norm.item() == pytest.approx(total, rel=NORM_RTOL)
        for g, g0 in zip(_grads(mo), grads, strict=True):
            assert_bitwise(g, g0, "the gradient was written")
        assert_matches_torch(ours, theirs, tol=VS_TORCH_CLIPPED, what=f"step {step}")
    assert 0 < clipped < 8, "the steps should clip sometimes, not always"


@pytest.mark.parametrize("scaler", [False, True], ids=["plain", "gradscaler"])
@pytest.mark.parametrize("mode", MODE_IDS)
def test_max_grad_norm_without_stats_like_torch(mode, scaler):
    """max_grad_norm without hierarchical_stats: a tensor-operation norm, on both paths
    and mixed groups, against clip_grad_norm_ + torch (unscale_ first under GradScaler,
    with an inf and a NaN injected: both skip)."""
    mo = Net()
    mt = twin(mo)
    ours = make_ours(mo, AMSGRAD, mode, max_grad_norm=MAX_NORM)
    theirs = make_torch(mt, AMSGRAD, fused=scaler)
    sc_o = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaler else None
    sc_t = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaler else None
    for step in range(1, 9):
        backward(mo, step, scaler=sc_o)
        with torch.no_grad():
            for g in _grads(mo):
                g.mul_(GRAD_SCALE[step])
            if scaler and step in INJECT_AT:  # GradScaler skips the step
                name, value = INJECT_AT[step]
                dict(mo.named_parameters())[name].grad.view(-1)[0] = value
        copy_grads(mo, mt)
        if scaler:
            _scaler_steps(sc_o, sc_t, ours, theirs, mt)
        else:
            _torch_clip(mt)
            ours.step()
            theirs.step()
        assert ours.last_report is None
        assert_matches_torch(ours, theirs, tol=VS_TORCH_CLIPPED, what=f"step {step}")


# ------------------------------------------------------------------- the report


def test_report_attributes_need_no_host_sync(monkeypatch):
    """The step and the report's attributes are built from device tensors: no .item(),
    bool() or float() on a tensor (a host sync on CUDA) until the caller asks."""
    mo = Net()
    ours = make_ours(mo, AMSGRAD, "fused", hierarchical_stats=True, max_grad_norm=MAX_NORM)
    _scaled_backward(mo, 1)
    ours.step()  # warm-up: buckets and buffers exist
    _scaled_backward(mo, 2)
    grads = [g.clone() for g in _grads(mo)]

    def sync(*args, **kwargs):
        raise AssertionError("host sync")

    with monkeypatch.context() as m:
        for name in ("item", "__bool__", "__float__", "__int__", "tolist", "cpu", "numpy"):
            m.setattr(torch.Tensor, name, sync)
        ours.step()
        report = ours.last_report
        values = [report.tensor, report.grad_norm, report.max_abs, report.nonfinite_count]
        values += [report.clip_coef, report.skipped]
    assert all(isinstance(v, torch.Tensor) for v in values)
    _check_report(report, grads, max_norm=MAX_NORM)


@pytest.mark.parametrize("max_norm", [None, MAX_NORM], ids=["no-clip", "clip"])
def test_report_without_clipping(max_norm):
    mo = Net()
    mt = twin(mo)
    ours = make_ours(mo, AMSGRAD, "fused", hierarchical_stats=True, max_grad_norm=max_norm)
    theirs = make_torch(mt, AMSGRAD)
    for step in range(1, 5):
        _scaled_backward(mo, step)
        copy_grads(mo, mt)
        grads = [g.clone() for g in _grads(mo)]
        if max_norm is not None:
            _torch_clip(mt)
        ours.step()
        theirs.step()
        _check_report(ours.last_report, grads, max_norm=max_norm)
    assert_matches_torch(ours, theirs, tol=VS_TORCH_CLIPPED)


# (id, [(parameter, value)]): non-finite values injected into the gradients of one step.
INJECTIONS = [
    ("nan-group0", [("fc1.weight", math.nan)]),
    ("+inf-group1", [("fc2.bias", math.inf)]),
    ("-inf-group0", [("fc2.weight", -math.inf)]),
    (
        "all-kinds-both-groups",
        [("fc1.weight", math.nan), ("extra", math.inf), ("fc1.bias", -math.inf)],
    ),
]


@pytest.mark.parametrize("max_norm", [None, MAX_NORM], ids=["no-clip", "clip"])
@pytest.mark.parametrize("inject", [i[1] for i in INJECTIONS], ids=[i[0] for i in INJECTIONS])
def test_nonfinite_gradient_skips_whole_step(inject, max_norm):
    """A NaN/inf anywhere skips the step for every group: parameters, moments, AMSGrad
    maxima and step counts bit-identical. The report counts the non-finite elements and
    excludes them from the norm and max. The next finite step continues like torch
    skipping that step."""
    mo = Net()
    mt = twin(mo)
    ours = make_ours(mo, AMSGRAD, "fused", hierarchical_stats=True, max_grad_norm=max_norm)
    theirs = make_torch(mt, AMSGRAD)

    def both(step):
        _scaled_backward(mo, step)
        copy_grads(mo, mt)
        if max_norm is not None:
            _torch_clip(mt)
        ours.step()
        theirs.step()

    for step in (1, 2, 3):
        both(step)
    _scaled_backward(mo, 5)  # every parameter has state and a gradient
    named = dict(mo.named_parameters())
    with torch.no_grad():
        for k, (name, value) in enumerate(inject):
            named[name].grad.view(-1)[k] = value
    grads = [g.clone() for g in _grads(mo)]
    before = snapshot(ours)
    ours.step()
    assert_same_snapshot(before, snapshot(ours), "the skipped step")
    _check_report(ours.last_report, grads, max_norm=max_norm, skipped=True)
    assert ours.last_report.nonfinite_count.item() == len(inject)
    for step in (6, 7, 8):
        both(step)
        assert not bool(ours.last_report.skipped)
        assert_matches_torch(ours, theirs, tol=VS_TORCH_CLIPPED, what=f"step {step}")


def test_found_inf_attribute_skips_with_stats():
    mo = Net()
    ours = make_ours(mo, AMSGRAD, "fused", hierarchical_stats=True, max_grad_norm=MAX_NORM)
    for step in (1, 2):
        _scaled_backward(mo, step)
        ours.step()
    _scaled_backward(mo, 3)
    grads = [g.clone() for g in _grads(mo)]
    before = snapshot(ours)
    ours.found_inf = torch.tensor([1.0])
    ours.step()
    del ours.found_inf
    assert_same_snapshot(before, snapshot(ours), "found_inf=1")
    _check_report(ours.last_report, grads, max_norm=MAX_NORM, skipped=True)
    assert ours.last_report.nonfinite_count.item() == 0


def test_gradscaler_with_stats_like_torch():
    """GradScaler + hierarchical_stats + max_grad_norm against GradScaler + unscale_ +
    clip_grad_norm_ + torch.optim.AdamW(fused=True): the report is over the unscaled
    gradient, an injected inf/NaN skips both, the scale schedules agree."""
    mo = Net()
    mt = twin(mo)
    ours = make_ours(mo, AMSGRAD, "fused", hierarchical_stats=True, max_grad_norm=MAX_NORM)
    theirs = make_torch(mt, AMSGRAD, fused=True)
    sc_o = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    sc_t = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for step in range(1, 9):
        backward(mo, step, scaler=sc_o)
        with torch.no_grad():
            for g in _grads(mo):
                g.mul_(GRAD_SCALE[step])
            if step in INJECT_AT:
                name, value = INJECT_AT[step]
                dict(mo.named_parameters())[name].grad.view(-1)[0] = value
        copy_grads(mo, mt)
        scale = sc_o.get_scale()
        grads = [g.clone() for g in _grads(mo)]
        before = snapshot(ours)
        _scaler_steps(sc_o, sc_t, ours, theirs, mt)
        skipped = step in INJECT_AT
        _check_report(ours.last_report, grads, max_norm=MAX_NORM, scale=scale, skipped=skipped)
        if skipped:
            assert sc_o.get_scale() == scale / 2
            assert_same_snapshot(
                {k: v for k, v in before.items() if v[1] is not None},
                {k: v for k, v in snapshot(ours).items() if before[k][1] is not None},
                f"skipped step {step}",
            )
        assert_matches_torch(ours, theirs, tol=VS_TORCH_CLIPPED, what=f"step {step}")


# ------------------------------------------------------------------- shapes of the work


def test_parameters_with_and_without_grads():
    """Only parameters with a gradient are in the report and the clip; the others keep
    no state and do not move (``extra`` sits out steps 1 and 4; ``never`` always)."""
    mo = Net()
    mo.never = nn.Parameter(torch.ones(7))
    mt = twin(mo)

    def build(model, cls, **kw):
        groups = [
            {"params": [model.fc1.weight, model.never, model.fc2.weight]},
            {"params": [model.fc1.bias, model.fc2.bias, model.empty, model.extra], "lr": 3e-3},
        ]
        return cls(groups, **TORCH_DEFAULTS, **kw)

    ours = build(mo, ruda_torch.AdamW, fused_step=True, hierarchical_stats=True, max_grad_norm=0.5)
    theirs = build(mt, torch.optim.AdamW, foreach=False)
    for step in range(1, 6):
        _scaled_backward(mo, step)
        copy_grads(mo, mt)
        grads = [g.clone() for g in _grads(mo)]
        _torch_clip(mt, 0.5)
        ours.step()
        theirs.step()
        _check_report(ours.last_report, grads, max_norm=0.5)
        assert_matches_torch(ours, theirs, tol=VS_TORCH_CLIPPED, what=f"step {step}")
    assert mo.never not in ours.state and torch.equal(mo.never, torch.ones(7))


@pytest.mark.parametrize("mode", ["fused-stats", "fused", "generic"])
def test_only_empty_gradients(mode):
    """A step whose only gradients have zero elements: nothing to do, no error, a zero
    report (not skipped)."""
    empty = nn.Parameter(torch.zeros(0))
    kw = {"fused-stats": dict(fused_step=True, hierarchical_stats=True, max_grad_norm=1.0),
          "fused": dict(fused_step=True, max_grad_norm=1.0),
          "generic": dict(max_grad_norm=1.0)}[mode]  # fmt: skip
    opt = ruda_torch.AdamW([empty], **kw)
    empty.grad = torch.zeros(0)
    opt.step()
    assert opt.state[empty]["step"].item() == 1
    if mode == "fused-stats":
        assert opt.last_report.tensor.tolist() == [0.0, 0.0, 0.0]
        assert not bool(opt.last_report.skipped)


def test_large_bucket_report():
    """A 4.5M-element gradient: 1099 statistics rows, more than one merge level (fan-in
    1024), in one bucket with a small tensor; a second group too. The norm against FP64
    within 1e-5 (Note [Report tolerance]); the step against clip_grad_norm_ + torch; and
    the same bits with 1 and 2 intra-op threads."""
    n = 4_500_000
    assert ruda_torch.ops.stats_rows_for(n) == 1099
    gen = torch.Generator().manual_seed(5)
    start = [torch.randn(n, generator=gen), torch.randn(97, generator=gen)]
    start.append(torch.randn(1025, generator=gen))
    grads = [torch.randn(t.shape, generator=gen) * 0.01 for t in start]
    grads[0][123_456] = 3.5  # a unique max_abs far into the big tensor

    def run(cls, threads, **kw):
        torch.set_num_threads(threads)
        ps = [nn.Parameter(t.clone()) for t in start]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        groups = [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]
        opt = cls(groups, **TORCH_DEFAULTS, **kw)
        if cls is torch.optim.AdamW:
            torch.nn.utils.clip_grad_norm_(ps, 1.0)
        opt.step()
        return ps, opt

    ps1, ours1 = run(
        ruda_torch.AdamW, 1, fused_step=True, hierarchical_stats=True, max_grad_norm=1.0
    )
    ps2, ours2 = run(
        ruda_torch.AdamW, 2, fused_step=True, hierarchical_stats=True, max_grad_norm=1.0
    )
    pt, _ = run(torch.optim.AdamW, 1, foreach=False)
    report = ours1.last_report
    _check_report(report, grads, max_norm=1.0, rtol=NORM_RTOL_LARGE)
    assert report.max_abs.item() == 3.5
    assert report.clip_coef.item() < 0.5, "the clip should be active"
    assert_bitwise(report.tensor, ours2.last_report.tensor, "report, 1 vs 2 threads")
    assert_bitwise_twins(ours1, ours2, "step, 1 vs 2 threads")
    for a, b in zip(ps1, pt, strict=True):
        VS_TORCH_CLIPPED.check(a, b, "parameter")


def test_stats_report_matches_tensor_norm_clip():
    """The native report's clip and the tensor-op clip (max_grad_norm alone) agree to
    within the norm tolerance: the two optimizers stay close step after step."""
    mo = Net()
    ma = twin(mo)
    case = Case("x", dict(TORCH_DEFAULTS))
    stats = make_ours(mo, case, "fused", hierarchical_stats=True, max_grad_norm=MAX_NORM)
    plain = make_ours(ma, case, "fused", max_grad_norm=MAX_NORM)
    for step in range(1, 9):
        _scaled_backward(mo, step)
        copy_grads(mo, ma)
        stats.step()
        plain.step()
    assert_matches_torch(stats, plain, tol=VS_TORCH_CLIPPED)


def test_resume_with_stats_is_bit_identical():
    """A checkpoint of a hierarchical_stats + max_grad_norm optimizer, through torch.save,
    into a fresh one: the statistics buffers are rebuilt and the continuation, reports
    included, is bit-identical."""
    import io

    mo = Net()
    kw = dict(hierarchical_stats=True, max_grad_norm=MAX_NORM)
    ours = make_ours(mo, AMSGRAD, "fused", **kw)
    for step in (1, 2, 3):
        _scaled_backward(mo, step)
        ours.step()
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    mr = twin(mo)
    resumed = make_ours(mr, AMSGRAD, "fused", **kw)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    for step in range(4, 9):
        _scaled_backward(mo, step)
        copy_grads(mo, mr)
        ours.step()
        resumed.step()
        assert_bitwise(ours.last_report.tensor, resumed.last_report.tensor, f"report {step}")
    assert_bitwise_twins(ours, resumed, "resumed with statistics")


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_materialization_step_with_stats(amsgrad):
    """torch.distributed.checkpoint's materialization (all-zero gradients, lr=0, one
    step) with hierarchical_stats and max_grad_norm: a zero norm is no reason to skip
    or to divide by zero; parameters bit-identical, every state key, step == 1."""
    mo = Net()
    case = Case("x", dict(TORCH_DEFAULTS, amsgrad=amsgrad))
    ours = make_ours(mo, case, "fused", hierarchical_stats=True, max_grad_norm=MAX_NORM)
    before = [p.detach().clone() for p in mo.parameters()]
    for p in mo.parameters():
        p.grad = torch.zeros_like(p)
    for g in ours.param_groups:
        g["lr"] = 0.0
    ours.step()
    assert ours.last_report.tensor.tolist() == [0.0, 0.0, 0.0]
    assert ours.last_report.clip_coef.item() == 1.0 and not bool(ours.last_report.skipped)
    for p, p0 in zip(mo.parameters(), before, strict=True):
        assert_bitwise(p.detach(), p0, "parameter")
        assert ours.state[p]["step"].item() == 1
        assert len(ours.state[p]) == (4 if amsgrad else 3)


def test_control_copies_wait_when_they_go_to_the_cpu(monkeypatch):
    """The rule behind mixed CPU/CUDA optimizers (ruda_torch._stats.to_device): a
    control value copied towards the CPU is copied blocking, since the CPU kernels read
    it at once; towards CUDA the copy is non-blocking (ordered on the stream)."""
    from ruda_torch import _stats

    seen = []

    def spy(self, device, non_blocking=False):
        seen.append((torch.device(device).type, non_blocking))
        return torch.ones(1)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    meta = torch.empty(1, device="meta")
    _stats.to_device(meta, torch.device("cpu"))
    _stats.to_device(meta, torch.device("cuda"))
    _stats.PerDevice().get(meta, torch.device("cpu"))
    assert seen == [("cpu", False), ("cuda", True), ("cpu", False)]


def test_max_grad_norm_set_between_steps_is_checked_and_read_by_the_next_step():
    """docs/usage.md: max_grad_norm (like partition_group, tests/test_distributed.py) is
    read by every step; set between steps it is checked as at construction."""
    mo = Net()
    ours = ruda_torch.AdamW(mo.parameters(), **TORCH_DEFAULTS, fused_step=True,
                            hierarchical_stats=True)  # fmt: skip
    for bad in (0.0, -1.0, float("nan"), "1.0", True):
        with pytest.raises(ValueError, match="max_grad_norm"):
            ours.max_grad_norm = bad
    assert ours.max_grad_norm is None
    _scaled_backward(mo, 1)
    ours.step()
    assert ours.last_report.clip_coef.item() == 1.0
    ours.max_grad_norm = 1e-3
    _scaled_backward(mo, 2)
    ours.step()
    assert ours.last_report.clip_coef.item() < 1.0
