"""Shared pieces of tests/test_optimizer.py and tests/test_optimizer_stats.py.

A small model trained side by side by ``ruda_torch.AdamW`` and ``torch.optim.AdamW``
from identical weights with identical gradients (the gradients are computed on our
model and copied to torch's, so that the two runs see exactly the same inputs), the
table of optimizer configurations, the tolerance of the comparisons with its reason,
and bitwise snapshot helpers for the "nothing changed" checks.

Every optimizer here is built with explicit hyperparameters: ruda_torch's defaults
(eps=1e-5, weight_decay=1e-4) differ from torch's (eps=1e-8, weight_decay=1e-2).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ruda_torch

# --------------------------------------------------------------------------- tolerances

FP32_EPS = 2.0**-23


@dataclass(frozen=True)
class Closeness:
    """|ours - torch| <= rtol * |torch| + atol_units * FP32_EPS * max|torch tensor|,
    elementwise. The absolute part is scaled by the tensor's own largest element, so one
    row serves parameters (~1), first moments (~1e-1) and second moments (~1e-4): an
    element that cancels to ~0 (a first moment crossing zero) still carries the rounding
    of the larger terms it was computed from, a few ulps of the tensor's scale."""

    rtol: float
    atol_units: float
    reason: str

    def check(self, actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        actual, expected = actual.detach(), expected.detach()
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
        if expected.numel() == 0:
            return
        scale = expected.abs().max().item()
        atol = self.atol_units * FP32_EPS * scale
        torch.testing.assert_close(
            actual, expected, rtol=self.rtol, atol=atol, msg=lambda m: f"{what}: {m}"
        )


# Note [Optimizer-level tolerance]
# ruda_torch and torch.optim.AdamW (single-tensor, or fused on CPU) evaluate the same FP32
# formula in different operation orders (torch: lerp for m, sqrt(v) / sqrt(1 - beta2^t)
# with the bias correction in FP64 on the host; docs/design.md section 1: sqrt(v / bc2) with bc2
# cast once to FP32). Each is within 1-2 FP32 ulps of the exact step (tests/tolerances.py
# measures that against the FP64 reference), and the differences do not amplify over
# steps (the moments do not depend on the parameters; weight decay contracts). Measured
# over the whole configuration table, 10 steps, every mode: beyond 1e-6 relative, the
# largest difference is 0.37 units of FP32_EPS x max|tensor| (first moments), 0.07 on
# parameters, 0 on second moments. rtol=2e-6 (~17 ulps) and 8 units leave a 20x margin
# and still fail a 10% error in weight decay or a 0.1% error in lr or beta2 within 10
# steps (1e-5 relative or more on the parameters), let alone the formula mistakes of
# tests/tolerances.py (eps inside the square root, decay on the gradient, bias
# correction one step off).
VS_TORCH = Closeness(rtol=2e-6, atol_units=8.0, reason="Note [Optimizer-level tolerance]")
# With clipping: the clip coefficient comes from an FP32 norm that ruda_torch sums in
# its own fixed order (statistics rows, fan-in 1024, or per-tensor norms) and
# clip_grad_norm_ in torch's; they are a few ulps apart, which scales every gradient
# of the step alike and which Adam's normalized update divides out again except
# through eps and the running moments.
VS_TORCH_CLIPPED = Closeness(rtol=2e-6, atol_units=8.0, reason="clip coefficients a few ulps apart")
EXACT = Closeness(rtol=0.0, atol_units=0.0, reason="copies of the same values")

TORCH_DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)

# --------------------------------------------------------------------------- the model


class Net(nn.Module):
    """An MLP with biases, a zero-size parameter (a gradient of zero elements every
    step) and ``extra``, a parameter that gets no gradient in some steps."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 4)
        self.empty = nn.Parameter(torch.zeros(0))
        self.extra = nn.Parameter(torch.zeros(5))
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def loss(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.fc2(torch.tanh(self.fc1(x)))
        loss = out.pow(2).mean() + self.empty.sum()
        if use_extra:
            loss = loss + (self.extra * x[0, :5]).sum()
        return loss


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(1000 + step))


def uses_extra(step: int) -> bool:
    """``extra`` has no gradient at steps 1, 4, 7, 10: its state starts at step 2 and
    then sits out every third step."""
    return step % 3 != 1


def split_groups(model: Net) -> tuple[list, list]:
    """Group 0: the weight matrices. Group 1: biases, the zero-size and the sometimes-
    without-gradient parameter (in the middle, so that the active parameters of the
    bucket are not a prefix)."""
    return (
        [model.fc1.weight, model.fc2.weight],
        [model.fc1.bias, model.extra, model.fc2.bias, model.empty],
    )


def backward(model: Net, step: int, scaler=None) -> torch.Tensor:
    """Fresh gradients of ``model`` for ``step`` (None where the step gives none)."""
    for p in model.parameters():
        p.grad = None
    loss = model.loss(batch(step), uses_extra(step))
    (loss if scaler is None else scaler.scale(loss)).backward()
    return loss


# Note [Twins share gradients]
# Runs compared with each other (ours against torch's, a resumed run against the one it
# was saved from, one layout or option against another) step from the same gradients:
# computed once, by one model's backward, and copied into the other models' gradients,
# never recomputed by a twin's own backward. That backward is another computation: through
# another layout or dtype of a parameter (a transposed one, a BF16 matmul), or from
# parameters a few ulps apart, the CPU's matmul kernels may round differently, and on some
# machines do (a BF16 weight's gradient 6e-5 apart through the other layout of a parameter
# beside it, on AMD Zen 3), so that a bit-for-bit comparison would test the machine's BLAS
# instead of the optimizer. copy_grads asserts what it promises: the same bits.
def copy_grads(src, dst) -> None:
    """Give the parameters of ``dst`` (a module or a list of parameters) the gradients of
    ``src``'s, bit for bit (Note [Twins share gradients]): copied into ``dst``'s own
    gradient tensor where it has one of the same shape and dtype (a flat gradient view
    stays a view, a layout stays), else into a new one laid out like the parameter; None
    where ``src`` has none."""
    sources, targets = _params_of(src), _params_of(dst)
    for j, (ps, pd) in enumerate(zip(sources, targets, strict=True)):
        if ps.grad is None:
            pd.grad = None
            continue
        g = ps.grad.detach()
        if pd.grad is not None and pd.grad.shape == g.shape and pd.grad.dtype == g.dtype:
            with torch.no_grad():
                pd.grad.copy_(g)
        else:
            pd.grad = torch.empty_like(pd, dtype=g.dtype).copy_(g)
        assert_bitwise(pd.grad, g, f"the twin's gradient of parameter {j}")


def _params_of(models) -> list:
    return list(models.parameters()) if isinstance(models, nn.Module) else list(models)


def step_twin(model: nn.Module, twin: tuple, scaler=None) -> None:
    """Step ``twin`` (a model and its optimizer) from copies of ``model``'s gradients,
    unscaled where ``scaler`` scaled them (a power-of-two scale divides exactly)."""
    twin_model, twin_opt = twin
    twin_opt.zero_grad()
    copy_grads(model, twin_model)
    if scaler is not None:
        for p in twin_model.parameters():
            p.grad /= scaler.get_scale()
    twin_opt.step()


class CountOps(TorchDispatchMode):
    """The torch operators dispatched while it is active, in ``ops``."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def train_pairs(pairs, steps) -> None:
    """Step (model_ours, ours, model_torch, theirs) pairs with identical gradients."""
    for step in steps:
        for mo, ours, mt, theirs in pairs:
            backward(mo, step)
            copy_grads(mo, mt)
            ours.step()
            theirs.step()


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


# --------------------------------------------------------------------------- configurations


@dataclass(frozen=True)
class Case:
    """One optimizer configuration: ``base`` holds the hyperparameters of the
    constructor (group 0), ``group1`` what param group 1 overrides."""

    id: str
    base: dict
    group1: dict = field(default_factory=dict)


CASES = [
    Case("torch-defaults", dict(TORCH_DEFAULTS)),
    Case("ruda-defaults", dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-5, weight_decay=1e-4)),
    Case("amsgrad", dict(TORCH_DEFAULTS, amsgrad=True)),
    Case("maximize", dict(TORCH_DEFAULTS, maximize=True)),
    Case("no-decay", dict(TORCH_DEFAULTS, weight_decay=0.0)),
    Case("decay-0.1-lr-1e-2", dict(TORCH_DEFAULTS, lr=1e-2, weight_decay=0.1)),
    Case("betas-eps", dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=1e-2)),
    Case(
        "amsgrad-maximize-decay",
        dict(TORCH_DEFAULTS, amsgrad=True, maximize=True, weight_decay=0.1),
    ),
    Case(
        "two-groups",
        dict(lr=1e-2, betas=(0.85, 0.995), eps=1e-8, weight_decay=0.1, amsgrad=True),
        dict(lr=2e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.0, maximize=True),
    ),
]
CASE_IDS = [c.id for c in CASES]

# fused_step of (group 0, group 1).
MODES = {
    "generic": (False, False),
    "fused": (True, True),
    "mixed": (True, False),
    "mixed-reversed": (False, True),
}
MODE_IDS = list(MODES)


def make_ours(model: Net, case: Case, mode: str, cls=None, **kwargs) -> ruda_torch.AdamW:
    """ruda_torch.AdamW (or ``cls``, e.g. ruda_torch.Adam) over the two groups."""
    f0, f1 = MODES[mode]
    g0, g1 = split_groups(model)
    groups = [{"params": g0}, {"params": g1, **case.group1, "fused_step": f1}]
    return (cls or ruda_torch.AdamW)(groups, **case.base, fused_step=f0, **kwargs)


def make_torch(model: Net, case: Case, cls=None, **kwargs) -> torch.optim.AdamW:
    """torch.optim.AdamW (or ``cls``, e.g. torch.optim.Adam) over the two groups."""
    g0, g1 = split_groups(model)
    groups = [{"params": g0}, {"params": g1, **case.group1}]
    kwargs.setdefault("foreach", False)
    if kwargs.get("fused"):
        kwargs.pop("foreach")
    return (cls or torch.optim.AdamW)(groups, **case.base, **kwargs)


# --------------------------------------------------------------------------- comparisons


def assert_matches_torch(ours, theirs, tol=VS_TORCH, what: str = "") -> None:
    """Parameters, which parameters have state, state keys, step counts (exact) and
    moments (within ``tol``) of two optimizers over the same parameter layout."""
    for gi, (go, gt) in enumerate(zip(ours.param_groups, theirs.param_groups, strict=True)):
        for j, (po, pt) in enumerate(zip(go["params"], gt["params"], strict=True)):
            where = f"{what} group {gi} param {j}"
            tol.check(po, pt, where)
            assert (po in ours.state) == (pt in theirs.state), f"{where}: state presence"
            if pt not in theirs.state:
                continue
            so, st = ours.state[po], theirs.state[pt]
            assert set(so) == set(st), f"{where}: state keys {sorted(so)} vs {sorted(st)}"
            assert so["step"].item() == st["step"].item(), f"{where}: step"
            for key in st:
                if key != "step":
                    tol.check(so[key], st[key], f"{where} {key}")


_INT_VIEW = {
    torch.float32: torch.int32,
    torch.float64: torch.int64,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Equal bit patterns (distinguishes -0.0 from 0.0 and compares NaNs)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (
        f"{what}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    )
    ia = a.detach().contiguous().view(_INT_VIEW.get(a.dtype, a.dtype))
    ib = b.detach().contiguous().view(_INT_VIEW.get(b.dtype, b.dtype))
    assert torch.equal(ia, ib), f"{what}: not bitwise equal\n{a}\nvs\n{b}"


def snapshot(opt) -> dict:
    """Copies of every parameter and state entry, by (group, position)."""
    snap = {}
    for gi, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            st = opt.state[p] if p in opt.state else None
            snap[gi, j] = (
                p.detach().clone(),
                None if st is None else {k: v.detach().clone() for k, v in st.items()},
            )
    return snap


def assert_same_snapshot(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys()
    for key in a:
        (pa, sa), (pb, sb) = a[key], b[key]
        assert_bitwise(pa, pb, f"{what} param {key}")
        assert (sa is None) == (sb is None), f"{what} state presence {key}"
        if sa is not None:
            assert sa.keys() == sb.keys(), f"{what} state keys {key}"
            for k in sa:
                assert_bitwise(sa[k], sb[k], f"{what} state {key} {k}")


def assert_bitwise_twins(opt_a, opt_b, what: str = "") -> None:
    assert_same_snapshot(snapshot(opt_a), snapshot(opt_b), what)
