"""ruda_torch.AdamW as a drop-in for torch.optim.AdamW (docs/design.md section 4).

Both paths (``fused_step=False``, the tensor-operation path, and ``fused_step=True``, the
native kernel on flat buckets), and groups mixing them, are trained side by side with
``torch.optim.AdamW`` over the configuration table of tests/optim_harness.py, from
identical weights with identical gradients, and compared within the tolerance of
Note [Optimizer-level tolerance]. Then the optimizer protocol (closure, zero_grad,
add_param_group, hooks, LR schedulers, state layout and state_dict format), validation
and its atomicity, checkpoints both ways, torch.distributed.checkpoint's state
materialization, and torch.amp.GradScaler. The gradient-statistics options are in
tests/test_optimizer_stats.py.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from optim_harness import (
    CASE_IDS,
    CASES,
    EXACT,
    MODE_IDS,
    MODES,
    TORCH_DEFAULTS,
    VS_TORCH,
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
    split_groups,
    train_pairs,
    twin,
)
from threads import num_threads
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import ruda_torch

BASE = CASES[0]  # torch's defaults, explicit
AMSGRAD = next(c for c in CASES if c.id == "amsgrad")
TWO_GROUPS = next(c for c in CASES if c.id == "two-groups")


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: the CPU kernels give the same bits at any thread count
    (docs/design.md section 2; test_thread_count_does_not_change_bits checks it), and on a
    shared 2-core machine waking the thread pool for these tiny buckets costs
    milliseconds per step."""
    with num_threads(1):
        yield


_train = train_pairs


def _side_by_side(case: Case, mode: str, **ours_kwargs):
    mo = Net()
    mt = twin(mo)
    return mo, make_ours(mo, case, mode, **ours_kwargs), mt, make_torch(mt, case)


# =========================================================================== 1. vs torch


@pytest.mark.parametrize("mode", MODE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_trains_like_torch(case, mode):
    """10 steps of the small model, compared after every step (Note [Optimizer-level
    tolerance]): parameters, state presence, step counts (exact) and moments."""
    mo, ours, mt, theirs = _side_by_side(case, mode)
    start = [p.detach().clone() for p in mo.parameters()]
    for step in range(1, 11):
        backward(mo, step)
        copy_grads(mo, mt)
        ours.step()
        theirs.step()
        assert_matches_torch(ours, theirs, what=f"step {step}")
    for p, p0 in zip(mo.parameters(), start, strict=True):
        if p.numel():
            assert not torch.equal(p, p0), "a parameter did not train"


# =========================================================================== 2. behaviour


@pytest.mark.parametrize("mode", MODE_IDS)
def test_step_closure_returns_loss(mode):
    mo, ours, mt, theirs = _side_by_side(BASE, mode)
    returned = []

    def closure():
        assert torch.is_grad_enabled(), "the closure must run with gradients enabled"
        loss = backward(mo, 1)
        copy_grads(mo, mt)
        returned.append(loss)
        return loss

    with torch.no_grad():
        loss = ours.step(closure)
    assert len(returned) == 1 and loss is returned[0]
    assert ours.step() is None  # without a closure (grads still set): returns None
    theirs.step()
    theirs.step()
    assert_matches_torch(ours, theirs)


@pytest.mark.parametrize("mode", MODE_IDS)
def test_step_closure_result_is_the_closure_object(mode):
    mo, ours, _, _ = _side_by_side(BASE, mode)
    sentinel = object()

    def closure():
        backward(mo, 1)
        return sentinel

    assert ours.step(closure) is sentinel


@pytest.mark.parametrize("mode", MODE_IDS)
def test_zero_grad(mode):
    """set_to_none=True drops the gradients; set_to_none=False zeroes them in place, and
    the next backward accumulates into the same tensors (the fused path caches its
    gradient checks on their identity), training like torch."""
    mo, ours, mt, theirs = _side_by_side(BASE, mode)
    _train([(mo, ours, mt, theirs)], [1])
    ours.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in mo.parameters())

    for step in range(2, 7):
        ours.zero_grad(set_to_none=False)
        theirs.zero_grad(set_to_none=False)
        kept = {id(p): p.grad for p in mo.parameters() if p.grad is not None}
        for p in kept.values():
            assert not p.any()
        mo.loss(torch.randn(8, 6, generator=torch.Generator().manual_seed(step)), True).backward()
        for p in mo.parameters():
            if id(p) in kept:
                assert p.grad is kept[id(p)], "backward must accumulate into the zeroed grad"
        copy_grads(mo, mt)
        ours.step()
        theirs.step()
    assert_matches_torch(ours, theirs)


@pytest.mark.parametrize("mode", MODE_IDS)
def test_add_param_group_after_construction(mode):
    f0, f1 = MODES[mode]
    mo = Net()
    mt = twin(mo)
    g0o, g1o = split_groups(mo)
    g0t, g1t = split_groups(mt)
    ours = ruda_torch.AdamW(g0o, **BASE.base, fused_step=f0)
    theirs = torch.optim.AdamW(g0t, **BASE.base, foreach=False)
    _train([(mo, ours, mt, theirs)], [1, 2])
    before = [p.detach().clone() for p in g1o]
    extra_hyper = dict(lr=5e-3, weight_decay=0.0, amsgrad=True)
    ours.add_param_group({"params": g1o, **extra_hyper, "fused_step": f1})
    theirs.add_param_group({"params": g1t, **extra_hyper})
    assert ours.param_groups[1]["fused_step"] is f1
    assert ours.param_groups[1]["eps"] == BASE.base["eps"]  # from the defaults
    _train([(mo, ours, mt, theirs)], range(3, 8))
    assert_matches_torch(ours, theirs)
    for p, p0 in zip(g1o, before, strict=True):
        if p.numel():
            assert not torch.equal(p, p0), "a parameter of the added group did not train"
        assert p in ours.state


def test_add_param_group_default_fused_step():
    mo = Net()
    g0, g1 = split_groups(mo)
    ours = ruda_torch.AdamW(g0, fused_step=True)
    ours.add_param_group({"params": g1})
    assert ours.param_groups[1]["fused_step"] is True
    with pytest.raises(ValueError, match="more than one parameter group"):
        ours.add_param_group({"params": [mo.fc1.weight]})


@pytest.mark.parametrize("mode", MODE_IDS)
def test_step_hooks_fire(mode):
    mo, ours, _, _ = _side_by_side(BASE, mode)
    seen = []

    def pre(opt, args, kwargs):
        assert opt is ours
        seen.append(("pre", mo.fc1.weight.detach().clone()))

    def post(opt, args, kwargs):
        assert opt is ours
        seen.append(("post", mo.fc1.weight.detach().clone()))

    h_pre = ours.register_step_pre_hook(pre)
    h_post = ours.register_step_post_hook(post)
    backward(mo, 1)
    ours.step()
    assert [s[0] for s in seen] == ["pre", "post"]
    assert not torch.equal(seen[0][1], seen[1][1]), "pre hook must run before the update"
    assert torch.equal(seen[1][1], mo.fc1.weight), "post hook must run after the update"
    h_pre.remove()
    h_post.remove()
    ours.step()
    assert len(seen) == 2

    glob = []
    handle = register_optimizer_step_post_hook(lambda opt, a, k: glob.append(opt))
    try:
        ours.step()
    finally:
        handle.remove()
    assert glob == [ours]


@pytest.mark.parametrize("mode", MODE_IDS)
def test_state_dict_hooks_fire(mode):
    mo, ours, _, _ = _side_by_side(BASE, mode)
    backward(mo, 1)
    ours.step()
    events = []
    ours.register_state_dict_pre_hook(lambda opt: events.append("sd_pre"))

    def sd_post(opt, sd):
        events.append("sd_post")
        sd["marker"] = 1
        return sd

    ours.register_state_dict_post_hook(sd_post)

    def load_pre(opt, sd):
        events.append("load_pre")
        sd = dict(sd)
        sd["param_groups"] = [dict(g, lr=0.5) for g in sd["param_groups"]]
        return sd

    def load_post(opt):
        events.append("load_post")
        assert len(opt.state) == 5  # every parameter but `extra`, which had no gradient

    ours.register_load_state_dict_pre_hook(load_pre)
    ours.register_load_state_dict_post_hook(load_post)
    sd = ours.state_dict()
    assert events == ["sd_pre", "sd_post"] and sd["marker"] == 1
    ours.load_state_dict(copy.deepcopy(sd))
    assert events == ["sd_pre", "sd_post", "load_pre", "load_post"]
    assert all(g["lr"] == 0.5 for g in ours.param_groups), "the pre hook's dict was not used"
    backward(mo, 2)
    ours.step()  # the rebuilt buckets still step


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    # OneCycleLR rewrites betas[0] (cycle_momentum) as well as lr, every step.
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[1e-2, 2e-2], total_steps=12, pct_start=0.4
    ),
    # Stochastic weight averaging's schedule: anneals every group to swa_lr.
    "SWALR": lambda opt: torch.optim.swa_utils.SWALR(opt, swa_lr=1e-4, anneal_epochs=5),
    "CosineAnnealingWarmRestarts": lambda opt: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(
        opt, T_0=4
    ),
    "SequentialLR": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8),
        ],
        milestones=[3],
    ),  # fmt: skip
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
}


@pytest.mark.parametrize("mode", MODE_IDS)
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_scheduler_like_torch(name, mode):
    mo, ours, mt, theirs = _side_by_side(TWO_GROUPS, mode)
    sched_o, sched_t = SCHEDULERS[name](ours), SCHEDULERS[name](theirs)
    lrs, betas = set(), set()
    for step in range(1, 12):
        backward(mo, step)
        copy_grads(mo, mt)
        ours.step()
        theirs.step()
        sched_o.step()
        sched_t.step()
        for go, gt in zip(ours.param_groups, theirs.param_groups, strict=True):
            assert go["lr"] == gt["lr"] and tuple(go["betas"]) == tuple(gt["betas"])
        lrs.add(ours.param_groups[0]["lr"])
        betas.add(ours.param_groups[0]["betas"][0])
        assert_matches_torch(ours, theirs, what=f"{name} step {step}")
    assert len(lrs) > 2
    if name == "OneCycleLR":
        assert len(betas) > 2, "OneCycleLR should have rewritten betas"


# Group options changed by the user mid-training (as a scheduler changes lr and betas):
# torch reads every option from the group at every step.
TOGGLES = {
    "amsgrad-off": {"amsgrad": False},
    "maximize-on": {"maximize": True},
    "weight-decay": {"weight_decay": 0.2},
    "eps": {"eps": 1e-2},
    "betas": {"betas": (0.5, 0.95)},
}


@pytest.mark.parametrize("mode", MODE_IDS)
@pytest.mark.parametrize("toggle", list(TOGGLES))
def test_group_options_read_every_step(toggle, mode):
    """4 steps with large gradients, then a group option changes in both optimizers,
    then 4 steps with small gradients (beta2=0.9 so that AMSGrad's maximum and the
    second moment part quickly: the amsgrad switch is visible)."""
    case = Case("x", dict(lr=1e-2, betas=(0.9, 0.9), eps=1e-8, weight_decay=1e-2, amsgrad=True))
    mo, ours, mt, theirs = _side_by_side(case, mode)
    for step in range(1, 9):
        if step == 5:
            for g in ours.param_groups + theirs.param_groups:
                g.update(TOGGLES[toggle])
        backward(mo, step)
        if step <= 4:
            with torch.no_grad():
                for p in mo.parameters():
                    if p.grad is not None:
                        p.grad.mul_(10.0)
        copy_grads(mo, mt)
        ours.step()
        theirs.step()
        assert_matches_torch(ours, theirs, what=f"{toggle} step {step}")


@pytest.mark.parametrize("mode", MODE_IDS)
def test_param_without_grad_keeps_state(mode):
    """``extra`` gets no gradient at steps 4 and 7: its state stays bit-identical and its
    step count stays equal to torch's, while the others advance."""
    mo, ours, mt, theirs = _side_by_side(AMSGRAD, mode)
    _train([(mo, ours, mt, theirs)], [1])
    assert mo.extra not in ours.state and mt.extra not in theirs.state
    _train([(mo, ours, mt, theirs)], [2, 3])
    for step in (4, 5, 6, 7):
        before = snapshot(ours)[1, 1]
        _train([(mo, ours, mt, theirs)], [step])
        after = snapshot(ours)[1, 1]
        if step in (4, 7):
            assert mo.extra.grad is None
            assert_same_snapshot({0: before}, {0: after}, f"extra at step {step}")
        else:
            assert after[1]["step"].item() == before[1]["step"].item() + 1
        assert ours.state[mo.extra]["step"].item() == theirs.state[mt.extra]["step"].item()
    assert ours.state[mo.fc1.weight]["step"].item() == 7
    assert ours.state[mo.extra]["step"].item() == 4
    assert_matches_torch(ours, theirs)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("mode", MODE_IDS)
def test_state_layout(mode, amsgrad):
    mo = Net()
    ours = make_ours(mo, Case("x", dict(TORCH_DEFAULTS, amsgrad=amsgrad)), mode)
    for step in (1, 2):
        backward(mo, step)
        ours.step()
    params = list(mo.parameters())
    assert list(ours.state.keys()) != [] and all(isinstance(k, nn.Parameter) for k in ours.state)
    assert {id(k) for k in ours.state} == {id(p) for p in params}
    assert len(ours.state) == len(params)
    keys = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
    for p in params:
        st = ours.state[p]
        assert set(st) == keys
        assert st["step"].dtype == torch.float32 and st["step"].dim() == 0
        assert st["step"].device == p.device
        for k in keys - {"step"}:
            assert st[k].shape == p.shape and st[k].dtype == p.dtype and st[k].device == p.device
    f0, f1 = MODES[mode]
    pairs = [(f0, (mo.fc1.weight, mo.fc2.weight)), (f1, (mo.fc1.bias, mo.extra))]
    for fused, (a, b) in pairs:
        if fused:
            # Note [Buckets]: the state of a fused group is views into shared flat buffers.
            for k in keys:
                sa, sb = ours.state[a][k], ours.state[b][k]
                assert sa.untyped_storage().data_ptr() == sb.untyped_storage().data_ptr(), k
                assert sa.data_ptr() != sb.data_ptr(), k
    # ... which the kernel updates in place: the same views see the next step.
    held = {p: ours.state[p]["exp_avg"] for p in params}
    ptrs = {p: t.untyped_storage().data_ptr() for p, t in held.items()}
    steps = {p: ours.state[p]["step"].item() for p in params}
    backward(mo, 3)
    ours.step()
    for p in params:
        assert ours.state[p]["exp_avg"] is held[p]
        assert held[p].untyped_storage().data_ptr() == ptrs[p]
        assert ours.state[p]["step"].item() == steps[p] + 1


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("mode", MODE_IDS)
def test_state_dict_format_is_torchs(mode, amsgrad):
    case = Case("x", dict(TORCH_DEFAULTS, amsgrad=amsgrad))
    mo, ours, mt, theirs = _side_by_side(case, mode)
    _train([(mo, ours, mt, theirs)], [1, 2, 3, 4])  # extra sits out step 4
    so, st = ours.state_dict(), theirs.state_dict()
    assert so.keys() == st.keys() == {"state", "param_groups"}
    assert so["state"].keys() == st["state"].keys()
    for idx in st["state"]:
        assert so["state"][idx].keys() == st["state"][idx].keys(), idx
        step = so["state"][idx]["step"]
        assert torch.is_tensor(step) and step.dtype == torch.float32 and step.dim() == 0
        assert step.item() == st["state"][idx]["step"].item()
    assert len(so["param_groups"]) == len(st["param_groups"])
    for go, gt in zip(so["param_groups"], st["param_groups"], strict=True):
        ours_only = {"fused_step", "master_weights", "stochastic_rounding", "rounding_seed",
                     "flat_grads", "state_precision", "state_rounding", "min_8bit_size"}  # fmt: skip
        assert set(go) - ours_only == set(gt)
        assert "fused_step" in go
        assert go["params"] == gt["params"]
        for k in gt:
            if k not in ("foreach", "params"):
                assert go[k] == gt[k], k


# =========================================================================== 3. validation

# (id, bad hyperparameters, the message torch.optim.AdamW gives too)
BAD_HYPERPARAMETERS = [
    ("lr-negative", dict(lr=-1.0), "Invalid learning rate: -1.0"),
    ("lr-nan", dict(lr=float("nan")), "Invalid learning rate: nan"),
    ("beta1-one", dict(betas=(1.0, 0.9)), "Invalid beta parameter at index 0: 1.0"),
    ("beta1-negative", dict(betas=(-0.1, 0.9)), "Invalid beta parameter at index 0: -0.1"),
    ("beta2-one", dict(betas=(0.9, 1.0)), "Invalid beta parameter at index 1: 1.0"),
    ("eps-negative", dict(eps=-1e-8), "Invalid epsilon value: -1e-08"),
    ("weight-decay-negative", dict(weight_decay=-0.1), "Invalid weight_decay value: -0.1"),
]


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
@pytest.mark.parametrize(
    "bad, message", [b[1:] for b in BAD_HYPERPARAMETERS], ids=[b[0] for b in BAD_HYPERPARAMETERS]
)
def test_invalid_hyperparameters(bad, message, fused):
    def params():
        return [nn.Parameter(torch.zeros(3))]

    kwargs = {**TORCH_DEFAULTS, **bad}
    with pytest.raises(ValueError, match=message):
        torch.optim.AdamW(params(), **kwargs)
    with pytest.raises(ValueError, match=message):
        ruda_torch.AdamW(params(), **kwargs, fused_step=fused)
    with pytest.raises(ValueError, match=message):  # as a group option
        ruda_torch.AdamW([{"params": params(), **bad}], **TORCH_DEFAULTS, fused_step=fused)
    opt = ruda_torch.AdamW(params(), **TORCH_DEFAULTS, fused_step=fused)
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": params(), **bad})
    assert len(opt.param_groups) == 1


BAD_OPTIONS = [
    (dict(hierarchical_stats=True), "hierarchical_stats=True requires fused_step=True"),
    (dict(fused_step=True, max_grad_norm=0.0), "Invalid max_grad_norm: 0.0"),
    (dict(fused_step=True, max_grad_norm=-1.0), "Invalid max_grad_norm: -1.0"),
    (dict(fused_step=True, max_grad_norm=float("nan")), "Invalid max_grad_norm: nan"),
    (dict(fused_step=True, max_grad_norm=float("inf")), "Invalid max_grad_norm: inf"),
    (dict(max_grad_norm=0), "Invalid max_grad_norm"),
]


@pytest.mark.parametrize("bad, message", BAD_OPTIONS, ids=[str(b) for b, _ in BAD_OPTIONS])
def test_invalid_options(bad, message):
    with pytest.raises(ValueError, match=message):
        ruda_torch.AdamW([nn.Parameter(torch.zeros(3))], **TORCH_DEFAULTS, **bad)


def test_hierarchical_stats_requires_fused_in_every_group():
    p, q = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="hierarchical_stats=True requires fused_step=True"):
        ruda_torch.AdamW(
            [{"params": [p]}, {"params": [q], "fused_step": False}],
            fused_step=True,
            hierarchical_stats=True,
        )
    opt = ruda_torch.AdamW([p], fused_step=True, hierarchical_stats=True)
    with pytest.raises(ValueError, match="hierarchical_stats=True requires fused_step=True"):
        opt.add_param_group({"params": [q], "fused_step": False})


FUSED_BAD_DTYPES = [torch.complex64, torch.int32, torch.float8_e4m3fn]


@pytest.mark.parametrize("dtype", FUSED_BAD_DTYPES, ids=str)
def test_fused_rejects_parameter_dtype(dtype):
    good = nn.Parameter(torch.zeros(3))
    bad = torch.zeros(3, dtype=dtype)
    if dtype.is_floating_point or dtype.is_complex:
        bad = nn.Parameter(bad)
    with pytest.raises(ValueError, match=rf"fused_step=True supports .*parameter 1 is {dtype}"):
        ruda_torch.AdamW([good, bad], fused_step=True)
    opt = ruda_torch.AdamW([good], fused_step=True)
    with pytest.raises(ValueError, match=rf"param group 1 parameter 0 is {dtype}"):
        opt.add_param_group({"params": [bad]})
    assert len(opt.param_groups) == 1, "a rejected add_param_group left its group behind"
    if dtype.is_complex:  # the generic path takes complex parameters
        opt.add_param_group({"params": [bad], "fused_step": False})


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_generic_path_other_dtypes_like_torch(dtype):
    """A generic group of FP64/BF16 parameters beside a fused FP32 group."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(7, 5, generator=gen)
    a = [nn.Parameter(w.clone()), nn.Parameter(w.to(dtype))]
    b = [nn.Parameter(w.clone()), nn.Parameter(w.to(dtype))]
    ours = ruda_torch.AdamW(
        [{"params": [a[0]]}, {"params": [a[1]], "fused_step": False}],
        **TORCH_DEFAULTS,
        fused_step=True,
    )
    theirs = torch.optim.AdamW([b[0], b[1]], **TORCH_DEFAULTS, foreach=False)
    for _ in range(4):
        g = torch.randn(7, 5, generator=gen)
        for x, y in zip(a, b, strict=True):
            x.grad, y.grad = g.to(x.dtype), g.to(y.dtype)
        ours.step()
        theirs.step()
    VS_TORCH.check(a[0], b[0], "FP32 parameter")
    # BF16: the two evaluate the formula in a different order in an 8-bit mantissa.
    tol = dict(rtol=1e-12, atol=1e-14) if dtype == torch.float64 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(a[1], b[1], **tol)
    assert ours.state[a[1]]["exp_avg"].dtype == dtype


def _sparse_like(p: torch.Tensor) -> torch.Tensor:
    idx = torch.tensor([[0, p.shape[0] - 1]])
    vals = torch.ones((2, *p.shape[1:]))
    return torch.sparse_coo_tensor(idx, vals, p.shape, check_invariants=True)


# (kind, error type, message, corrupts): what makes the step fail.
BAD_STEPS = {
    "sparse-grad": (RuntimeError, "sparse"),
    "negative-lr": (ValueError, "Invalid learning rate"),
}


BAD_STEP_PARAMS = [
    pytest.param(kind, mode, bad_group, id=f"{kind}-{mode}-group{bad_group}")
    for kind in BAD_STEPS
    for mode in MODE_IDS
    for bad_group in (0, 1)
]


@pytest.mark.parametrize("kind, mode, bad_group", BAD_STEP_PARAMS)
def test_rejected_step_changes_nothing(kind, mode, bad_group):
    """The step is rejected before anything is written, even when the bad input is in
    the second param group and the first is valid, and even for a parameter that would
    get its first state in that step; afterwards the optimizer steps exactly like a
    twin that never saw the bad step."""
    mo, ours, _, _ = _side_by_side(AMSGRAD, mode)
    mt = twin(mo)
    ours_twin = make_ours(mt, AMSGRAD, mode)
    backward(mo, 1)  # extra has no gradient at step 1: no state yet
    copy_grads(mo, mt)
    ours.step()
    ours_twin.step()
    backward(mo, 2)
    copy_grads(mo, mt)
    assert mo.extra.grad is not None and mo.extra not in ours.state
    bad_param = (mo.fc2.weight, mo.fc2.bias)[bad_group]
    good_grad = bad_param.grad
    error, message = BAD_STEPS[kind]
    if kind == "sparse-grad":
        bad_param.grad = _sparse_like(bad_param)
    else:
        ours.param_groups[bad_group]["lr"] = -1.0
    before = snapshot(ours)
    with pytest.raises(error, match=message):
        ours.step()
    assert_same_snapshot(before, snapshot(ours), f"after the rejected {kind} step")
    assert mo.extra not in ours.state, "state was created by a rejected step"
    assert len(ours.state) == len(before) - 1

    bad_param.grad = good_grad
    ours.param_groups[bad_group]["lr"] = AMSGRAD.base["lr"]
    ours.step()
    ours_twin.step()
    assert_bitwise_twins(ours, ours_twin, "first step after the rejected one")
    for step in (3, 4):
        backward(mo, step)
        copy_grads(mo, mt)
        ours.step()
        ours_twin.step()
    assert_bitwise_twins(ours, ours_twin, "after two more steps")


@pytest.mark.parametrize("bad_group", [0, 1])
def test_noncontiguous_grad_swapped_through_data_is_stepped_as_its_values(bad_group):
    """A gradient made non-contiguous in place (``p.grad.data = ...``, the object
    unchanged) is read in its own layout at every step: the fused step equals a twin's
    with the same values contiguous, bit for bit."""
    mo, ours, _, _ = _side_by_side(AMSGRAD, "fused")
    mt = twin(mo)
    ours_twin = make_ours(mt, AMSGRAD, "fused")
    backward(mo, 2)
    copy_grads(mo, mt)
    ours.step()
    ours_twin.step()
    backward(mo, 3)
    copy_grads(mo, mt)
    bad = (mo.fc2.weight, mo.fc2.bias)[bad_group]
    strided = torch.empty(*bad.shape, 2)[..., 0]
    strided.copy_(bad.grad)
    bad.grad.data = strided
    assert not bad.grad.is_contiguous()
    ours.step()
    ours_twin.step()
    assert_bitwise_twins(ours, ours_twin, "after a step with a strided gradient")


def test_sparse_embedding_gradient_is_rejected():
    emb = nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 3])).sum().backward()
    for fused in (False, True):
        opt = ruda_torch.AdamW(emb.parameters(), fused_step=fused)
        w = emb.weight.detach().clone()
        with pytest.raises(RuntimeError, match="sparse"):
            opt.step()
        assert torch.equal(w, emb.weight) and len(opt.state) == 0


@pytest.mark.parametrize("mode", MODE_IDS)
def test_noncontiguous_gradients_like_torch(mode):
    mo, ours, mt, theirs = _side_by_side(BASE, mode)
    for step in range(1, 4):
        backward(mo, step)
        for p in mo.parameters():
            if p.grad is not None and p.dim() == 2:
                p.grad = p.grad.t().contiguous().t()
                assert not p.grad.is_contiguous()
        copy_grads(mo, mt)
        ours.step()
        theirs.step()
    assert_matches_torch(ours, theirs)


# =========================================================================== 4. checkpoints


def _roundtrip(sd: dict, via: str) -> dict:
    if via == "deepcopy":
        return copy.deepcopy(sd)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("mode", MODE_IDS)
def test_our_checkpoint_loads_into_torch(mode, amsgrad):
    """Ours trains 4 steps; torch.optim.AdamW loads our state dict (through torch.save,
    as a checkpoint would) and both continue with identical gradients."""
    case = Case("x", dict(TORCH_DEFAULTS, amsgrad=amsgrad), TWO_GROUPS.group1)
    mo = Net()
    ours = make_ours(mo, case, mode)
    for step in range(1, 5):
        backward(mo, step)
        ours.step()
    mt = twin(mo)
    theirs = make_torch(mt, Case("fresh", TORCH_DEFAULTS))
    theirs.load_state_dict(_roundtrip(ours.state_dict(), "bytesio"))
    assert_matches_torch(ours, theirs, tol=EXACT, what="right after loading")
    _train([(mo, ours, mt, theirs)], range(5, 11))
    assert_matches_torch(ours, theirs)


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("mode", MODE_IDS)
def test_torch_checkpoint_loads_into_ours(mode, amsgrad):
    case = Case("x", dict(TORCH_DEFAULTS, amsgrad=amsgrad), TWO_GROUPS.group1)
    mt = Net()
    theirs = make_torch(mt, case)
    for step in range(1, 5):
        backward(mt, step)
        theirs.step()
    mo = twin(mt)
    ours = make_ours(mo, Case("fresh", dict(lr=0.1)), mode)
    ours.load_state_dict(_roundtrip(theirs.state_dict(), "deepcopy"))
    assert [g["fused_step"] for g in ours.param_groups] == list(MODES[mode])
    assert [g["amsgrad"] for g in ours.param_groups] == [amsgrad, amsgrad]
    assert_matches_torch(ours, theirs, tol=EXACT, what="right after loading")
    _train([(mo, ours, mt, theirs)], range(5, 11))
    assert_matches_torch(ours, theirs)


@pytest.mark.parametrize(
    "via, by_keyword, saved_after",
    [("deepcopy", False, 4), ("bytesio", False, 1), ("bytesio", True, 4)],
    ids=["deepcopy", "bytesio-early", "bytesio-keyword"],
)
@pytest.mark.parametrize("mode", MODE_IDS)
def test_resume_is_bit_identical(mode, via, by_keyword, saved_after):
    """Save after 4 steps (``extra`` has a different step count than the others) or
    after 1 (``extra`` has no state yet), load into a FRESH optimizer over a copy of the
    model, continue: bit-identical to the optimizer that never stopped."""
    mo = Net()
    ours = make_ours(mo, AMSGRAD, mode)
    for step in range(1, saved_after + 1):
        backward(mo, step)
        ours.step()
    mr = twin(mo)
    resumed = make_ours(mr, Case("fresh", dict(lr=0.5, eps=1e-3)), mode)
    sd = _roundtrip(ours.state_dict(), via)
    if by_keyword:
        resumed.load_state_dict(state_dict=sd)
    else:
        resumed.load_state_dict(sd)
    assert_bitwise_twins(ours, resumed, "right after loading")
    assert resumed.param_groups[0]["lr"] == AMSGRAD.base["lr"]
    for step in range(saved_after + 1, 11):
        backward(mo, step)
        copy_grads(mo, mr)
        ours.step()
        resumed.step()
        assert_bitwise_twins(ours, resumed, f"step {step}")
    f0, f1 = MODES[mode]
    if f0:  # the loaded state was rebuilt into buckets (Note [Buckets])
        a, b = resumed.state[mr.fc1.weight], resumed.state[mr.fc2.weight]
        assert (
            a["exp_avg"].untyped_storage().data_ptr() == b["exp_avg"].untyped_storage().data_ptr()
        )


@pytest.mark.parametrize("mode", MODE_IDS)
def test_old_checkpoint_with_python_int_steps(mode):
    """Checkpoints of torch < 1.12 hold ``step`` as a Python int: it loads as a float32
    0-dim tensor and continues exactly like the same checkpoint with tensor steps."""
    mo = Net()
    ours = make_ours(mo, AMSGRAD, mode)
    for step in (1, 2, 3):
        backward(mo, step)
        ours.step()
    sd = copy.deepcopy(ours.state_dict())
    old = copy.deepcopy(sd)
    for st in old["state"].values():
        st["step"] = int(st["step"].item())
    ma, mb = twin(mo), twin(mo)
    a, b = make_ours(ma, AMSGRAD, mode), make_ours(mb, AMSGRAD, mode)
    a.load_state_dict(sd)
    b.load_state_dict(old)
    for p in mb.parameters():
        st = b.state[p]
        assert st["step"].dtype == torch.float32 and st["step"].dim() == 0
    for step in (4, 5):
        backward(ma, step)
        copy_grads(ma, mb)
        a.step()
        b.step()
    assert_bitwise_twins(a, b, "int steps vs tensor steps")


@pytest.mark.parametrize("mode", MODE_IDS)
def test_deepcopy_of_the_optimizer(mode):
    """copy.deepcopy (pickling goes through the same __getstate__/__setstate__) gives an
    independent optimizer over copied parameters that steps exactly like the original."""
    mo = Net()
    ours = make_ours(mo, AMSGRAD, mode)
    for step in (1, 2, 3):
        backward(mo, step)
        ours.step()
    clone = copy.deepcopy(ours)
    assert_bitwise_twins(ours, clone, "right after deepcopy")
    cloned_params = [p for g in clone.param_groups for p in g["params"]]
    params = [p for g in ours.param_groups for p in g["params"]]
    assert not any(a is b for a, b in zip(params, cloned_params, strict=True))
    for step in (4, 5, 6):
        backward(mo, step)
        for a, b in zip(params, cloned_params, strict=True):
            b.grad = None if a.grad is None else a.grad.clone()
        ours.step()
        clone.step()
    assert_bitwise_twins(ours, clone, "stepped after deepcopy")


EXTRA = 3  # state_dict index of `extra`: group 0 has 2 parameters, it is 2nd in group 1


def _corrupt(kind: str, sd: dict) -> None:
    # First change valid parts, so that a partial load would show.
    for st in sd["state"].values():
        st["exp_avg"].mul_(2)
        st["step"] = torch.tensor(50.0)
    for g in sd["param_groups"]:
        g["lr"] = 0.5
    if kind == "state-shape":
        sd["state"][EXTRA]["exp_avg"] = torch.zeros(2, 3)
    elif kind == "extra-group":
        sd["param_groups"].append(dict(sd["param_groups"][1], params=[]))
    elif kind == "missing-group":
        sd["param_groups"].pop()
    elif kind == "fewer-params":
        sd["param_groups"][1]["params"].pop()
    elif kind == "unknown-index":
        sd["state"][99] = sd["state"][0]
    elif kind == "step-shape":
        sd["state"][EXTRA]["step"] = torch.zeros(2)
    elif kind == "integer-state":
        sd["state"][EXTRA]["exp_avg_sq"] = torch.zeros(5, dtype=torch.int64)
    elif kind == "negative-lr":
        sd["param_groups"][1]["lr"] = -1.0
    else:
        raise AssertionError(kind)


BAD_LOADS = [
    "state-shape",
    "extra-group",
    "missing-group",
    "fewer-params",
    "unknown-index",
    "step-shape",
    "integer-state",
    "negative-lr",
]


@pytest.mark.parametrize("mode", ["generic", "fused", "mixed"])
@pytest.mark.parametrize("kind", BAD_LOADS)
def test_rejected_load_changes_nothing(kind, mode):
    mo, ours, _, _ = _side_by_side(AMSGRAD, mode)
    mt = twin(mo)
    ours_twin = make_ours(mt, AMSGRAD, mode)
    for step in (1, 2, 3):
        backward(mo, step)
        copy_grads(mo, mt)
        ours.step()
        ours_twin.step()
    sd = copy.deepcopy(ours.state_dict())
    assert set(sd["state"]) == {0, 1, 2, 3, 4, 5}  # EXTRA is `extra`, 5 elements
    _corrupt(kind, sd)
    with pytest.raises(ValueError):
        ours.load_state_dict(sd)
    assert [g["lr"] for g in ours.param_groups] == [AMSGRAD.base["lr"]] * 2
    assert_bitwise_twins(ours, ours_twin, "after the rejected load")
    for step in (4, 5, 6):
        backward(mo, step)
        copy_grads(mo, mt)
        ours.step()
        ours_twin.step()
    assert_bitwise_twins(ours, ours_twin, "steps after the rejected load")


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_loaded_torch_dict_keeps_constructor_fused_step(fused):
    mt = Net()
    theirs = make_torch(mt, BASE)
    backward(mt, 2)
    theirs.step()
    sd = copy.deepcopy(theirs.state_dict())
    assert all("fused_step" not in g for g in sd["param_groups"])
    mo = twin(mt)
    g0, g1 = split_groups(mo)
    ours = ruda_torch.AdamW([{"params": g0}, {"params": g1}], fused_step=fused)
    ours.load_state_dict(sd)
    assert [g["fused_step"] for g in ours.param_groups] == [fused, fused]
    assert ours.param_groups[0]["eps"] == TORCH_DEFAULTS["eps"]  # from the checkpoint
    a, b = ours.state[mo.fc1.weight], ours.state[mo.fc2.weight]
    shared = a["exp_avg"].untyped_storage().data_ptr() == b["exp_avg"].untyped_storage().data_ptr()
    assert shared == fused
    # A dict that does carry fused_step wins, like every other group option in torch.
    sd2 = copy.deepcopy(ours.state_dict())
    sd2["param_groups"][1]["fused_step"] = not fused
    ours.load_state_dict(sd2)
    assert [g["fused_step"] for g in ours.param_groups] == [fused, not fused]
    _train([(mo, ours, mt, theirs)], [3, 4])
    assert_matches_torch(ours, theirs)


@pytest.mark.parametrize("mode", MODE_IDS)
def test_amsgrad_resumed_from_non_amsgrad_torch_dict(mode):
    """A torch non-AMSGrad checkpoint (no max_exp_avg_sq) resumed with amsgrad=True:
    the maximum starts at zero (so the first resumed step uses the new second moment),
    like torch.optim.AdamW(amsgrad=True) given a zero max_exp_avg_sq (torch itself
    raises KeyError on this dict)."""
    mt = Net()
    theirs = make_torch(mt, BASE)
    for step in range(1, 4):
        backward(mt, step)
        theirs.step()
    sd = copy.deepcopy(theirs.state_dict())
    for g in sd["param_groups"]:
        g["amsgrad"] = True
    mo = twin(mt)
    ours = make_ours(mo, BASE, mode)
    ours.load_state_dict(copy.deepcopy(sd))
    ref_sd = copy.deepcopy(sd)
    for st in ref_sd["state"].values():
        st["max_exp_avg_sq"] = torch.zeros_like(st["exp_avg_sq"])
    ref_model = twin(mt)
    ref = make_torch(ref_model, AMSGRAD)
    ref.load_state_dict(ref_sd)
    _train([(mo, ours, ref_model, ref)], range(4, 9))
    for p in mo.parameters():
        assert "max_exp_avg_sq" in ours.state[p]
    assert_matches_torch(ours, ref)


# =========================================================================== 5. DCP


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("mode", MODE_IDS)
def test_zero_grad_lr0_step_materializes_state(mode, amsgrad):
    """What torch.distributed.checkpoint does to a fresh optimizer: all-zero gradients,
    lr=0, one step. Parameters stay bit-identical; every state key exists, step == 1."""
    mo = Net()
    ours = make_ours(mo, Case("x", dict(TORCH_DEFAULTS, amsgrad=amsgrad, weight_decay=0.1)), mode)
    before = [p.detach().clone() for p in mo.parameters()]
    for p in mo.parameters():
        p.grad = torch.zeros_like(p)
    for g in ours.param_groups:
        g["lr"] = 0.0
    ours.step()
    keys = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if amsgrad else set())
    for p, p0 in zip(mo.parameters(), before, strict=True):
        assert_bitwise(p.detach(), p0, "parameter")
        st = ours.state[p]
        assert set(st) == keys
        assert st["step"].item() == 1.0
        for k in keys - {"step"}:
            assert st[k].shape == p.shape and not st[k].any()


@pytest.mark.parametrize("mode", MODE_IDS)
def test_distributed_checkpoint_state_dict_roundtrip(mode):
    """The real torch.distributed.checkpoint.state_dict API on a single-process model
    (it needs no process group there): get on a fresh optimizer materializes the state
    without touching the parameters; get after training and set into a fresh optimizer
    continue bit-identically."""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mo = Net()
    ours = make_ours(mo, AMSGRAD, mode)
    before = [p.detach().clone() for p in mo.parameters()]
    fresh_sd = get_optimizer_state_dict(mo, ours)
    for p, p0 in zip(mo.parameters(), before, strict=True):
        assert_bitwise(p.detach(), p0, "parameter after materialization")
    names = {n for n, _ in mo.named_parameters()}
    assert set(fresh_sd["state"]) == names
    assert all(st["step"].item() == 1 for st in fresh_sd["state"].values())
    assert all(p.grad is None for p in mo.parameters())

    for step in range(1, 5):
        backward(mo, step)
        ours.step()
    sd = copy.deepcopy(get_optimizer_state_dict(mo, ours))
    assert set(sd["state"]) == names
    assert {k for g in sd["param_groups"] for k in g["params"]} == names
    mr = twin(mo)
    resumed = make_ours(mr, Case("fresh", dict(lr=0.3)), mode)
    set_optimizer_state_dict(mr, resumed, sd)
    assert_bitwise_twins(ours, resumed, "after set_optimizer_state_dict")
    for step in range(5, 9):
        backward(mo, step)
        copy_grads(mo, mr)
        ours.step()
        resumed.step()
    assert_bitwise_twins(ours, resumed, "continued after set_optimizer_state_dict")


# =========================================================================== 6. GradScaler

INJECT = {1: "fc1.weight", 4: "fc2.bias", 8: "extra"}  # step -> parameter given an inf


def _inject_inf(model: nn.Module, name: str, value: float = math.inf) -> None:
    p = dict(model.named_parameters())[name]
    with torch.no_grad():
        p.grad.view(-1)[0] = value


@pytest.mark.parametrize(
    "case, unscale_first",
    [(BASE, False), (AMSGRAD, True)],
    ids=["adamw-step", "amsgrad-unscale-then-step"],
)
@pytest.mark.parametrize("mode", MODE_IDS)
def test_gradscaler_like_torch_fused(mode, case, unscale_first):
    """GradScaler driving ours and torch.optim.AdamW(fused=True) side by side, with inf
    injected at steps 1 (before any state), 4 and 8: both skip (parameters, moments and
    step counts unchanged), the scale schedules are identical, and the parameters match.
    Our step never writes the gradients (torch's fused step writes the unscaled ones)."""
    mo = Net()
    mt = twin(mo)
    ours = make_ours(mo, case, mode)
    theirs = make_torch(mt, case, fused=True)
    scaler_o = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler_t = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scales = []
    for step in range(1, 10):
        backward(mo, step, scaler=scaler_o)
        copy_grads(mo, mt)
        scaler_t.scale(torch.zeros(()))  # initializes torch's scaler like a real backward
        if step in INJECT:
            _inject_inf(mo, INJECT[step])
            _inject_inf(mt, INJECT[step])
        grads = {n: p.grad.clone() for n, p in mo.named_parameters() if p.grad is not None}
        before_o, before_t = snapshot(ours), snapshot(theirs)
        if unscale_first:
            scaler_o.unscale_(ours)
            scaler_t.unscale_(theirs)
            grads = {n: p.grad.clone() for n, p in mo.named_parameters() if p.grad is not None}
        scaler_o.step(ours)
        scaler_t.step(theirs)
        assert not hasattr(ours, "found_inf") and not hasattr(ours, "grad_scale")
        for n, p in mo.named_parameters():
            if p.grad is not None:
                assert_bitwise(p.grad, grads[n], f"gradient {n} was written")
        scaler_o.update()
        scaler_t.update()
        scales.append(scaler_o.get_scale())
        assert scaler_o.get_scale() == scaler_t.get_scale()
        if step in INJECT:
            after_o, after_t = snapshot(ours), snapshot(theirs)
            for key, (p, st) in before_o.items():
                assert_bitwise(p, after_o[key][0], f"skipped step {step} param {key}")
                if st is not None:
                    assert_same_snapshot({0: (p, st)}, {0: after_o[key]}, f"skipped step {step}")
            assert_same_snapshot(
                {k: v for k, v in before_t.items() if v[1] is not None},
                {k: v for k, v in after_t.items() if before_t[k][1] is not None},
                "torch's skipped step",
            )
        assert_matches_torch(ours, theirs, what=f"step {step}")
    # Halved after each skipped step, doubled after every 2 clean ones in a row.
    assert scales == [2.0**k for k in (9, 9, 10, 9, 9, 10, 10, 9, 9)]


@pytest.mark.parametrize("mode", MODE_IDS)
def test_grad_scale_and_found_inf_attributes(mode):
    mo, ours, _, _ = _side_by_side(AMSGRAD, mode)
    mt = twin(mo)
    ours_twin = make_ours(mt, AMSGRAD, mode)
    for step in (1, 2):
        backward(mo, step)
        copy_grads(mo, mt)
        ours.step()
        ours_twin.step()
    backward(mo, 3)
    ours.grad_scale = torch.tensor([4.0])
    for found_inf in (torch.tensor(2.0), torch.tensor([1.0]), torch.tensor(-1.0)):
        ours.found_inf = found_inf
        before = snapshot(ours)
        ours.step()
        assert_same_snapshot(before, snapshot(ours), f"found_inf={found_inf}")
    ours.found_inf = torch.tensor([0.0])
    ours.step()
    # The twin gets the gradient divided by 4 (exact: a power of two) and no scale.
    for pt, po in zip(mt.parameters(), mo.parameters(), strict=True):
        pt.grad = None if po.grad is None else po.grad / 4
    ours_twin.step()
    assert_bitwise_twins(ours, ours_twin, "grad_scale=4 vs gradients / 4")
    ours.found_inf = torch.tensor(0.0)
    del ours.grad_scale
    copy_grads(mo, mt)
    ours.step()
    ours_twin.step()
    assert_bitwise_twins(ours, ours_twin, "found_inf=0, no grad_scale")
    del ours.found_inf
    for step in (4, 5):
        backward(mo, step)
        copy_grads(mo, mt)
        ours.step()
        ours_twin.step()
    assert_bitwise_twins(ours, ours_twin, "attributes deleted")


@pytest.mark.parametrize("mode", ["fused", "mixed"])
def test_thread_count_does_not_change_bits(mode):
    """The fused step gives the same bits with 1 and 2 intra-op threads, on a bucket
    large enough to be split between threads (65537 + 1025 + 97 elements: leftover
    loops too)."""

    def run(threads):
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(11)
        params = [nn.Parameter(torch.randn(n, generator=gen)) for n in (65537, 1025, 97)]
        opt = ruda_torch.AdamW(
            [{"params": params[:2]}, {"params": params[2:], "fused_step": MODES[mode][1]}],
            **TORCH_DEFAULTS,
            amsgrad=True,
            fused_step=True,
        )
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        return opt

    assert_bitwise_twins(run(1), run(2), "1 vs 2 threads")


# --------------------------------------------------------------- swapped param_groups
# Note [Swapped param_groups] in ruda_torch/optimizer.py: DeepSpeed's ZeRO 1/2 steps the
# client optimizer one group at a time by assigning a one-group list to param_groups.


def _two_group_model(**kwargs):
    torch.manual_seed(7)
    ps = [torch.nn.Parameter(torch.randn(n)) for n in (97, 1025, 33)]
    opt = ruda_torch.AdamW([{"params": ps[:2]}, {"params": ps[2:]}], fused_step=True, **kwargs)
    return ps, opt


def _swap_step(opt) -> None:
    """What DeepSpeed's stage_1_and_2 does for every group."""
    whole = opt.param_groups
    for group in list(whole):
        opt.param_groups = [group]
        try:
            opt.step()
        finally:
            opt.param_groups = whole


def test_swapped_param_groups_step_as_whole_and_keep_their_buckets():
    ps, opt = _two_group_model()
    twins, ref = _two_group_model()
    for step in range(3):
        for p, q in zip(ps, twins, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        _swap_step(opt)
        ref.step()
        if step == 0:
            buckets = {id(b) for g in opt.param_groups for b in _buckets_of(opt, g)}
    for p, q in zip(ps, twins, strict=True):
        assert_bitwise(p, q)
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], ref.state[q][k]), k
    # No bucket was rebuilt by the swaps: the state entries are views of the first ones.
    after = {id(b) for g in opt.param_groups for b in _buckets_of(opt, g)}
    assert after == buckets


def _buckets_of(opt, group):
    plan = opt._current_plan()
    return [b for _, g, bs in plan.groups if g is group for b in bs] + [
        b for b in plan.spare if any(p is q for p in b.params for q in group["params"])
    ]


@pytest.mark.parametrize(
    "kwargs", [dict(max_grad_norm=1.0), dict(hierarchical_stats=True)], ids=["clip", "stats"]
)
def test_swapped_param_groups_refuse_a_per_group_norm(kwargs):
    ps, opt = _two_group_model(**kwargs)
    for p in ps:
        p.grad = torch.randn_like(p)
    before = [p.detach().clone() for p in ps]
    with pytest.raises(
        ValueError, match='holds 1 of this optimizer.s 2 param groups.*"gradient_clipping"'
    ):
        _swap_step(opt)
    for p, b in zip(ps, before, strict=True):
        assert_bitwise(p, b)
    assert not opt.state, "a refused step creates no state"
    # Removing a group for good, in place, is not a swap.
    del opt.param_groups[1]
    opt.step()
    assert not torch.equal(ps[0], before[0]) and torch.equal(ps[2], before[2])


def test_param_group_may_not_override_an_optimizer_wide_option():
    p = torch.nn.Parameter(torch.randn(5))
    with pytest.raises(ValueError, match="max_grad_norm is an optimizer-wide option"):
        ruda_torch.AdamW([{"params": [p], "max_grad_norm": 2.0}], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="hierarchical_stats is an optimizer-wide option"):
        ruda_torch.AdamW([{"params": [p], "hierarchical_stats": True}], fused_step=True)
    # Equal values (what ZeroRedundancyOptimizer passes) are accepted.
    opt = ruda_torch.AdamW([{"params": [p], "max_grad_norm": 1.0, "process_group": None}],
                           max_grad_norm=1.0)  # fmt: skip
    assert opt.param_groups[0]["max_grad_norm"] == 1.0
