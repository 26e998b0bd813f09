"""flat_grads=True (Note [Flat gradient buckets] in ruda_torch/_fused.py): every p.grad
is a view of its bucket's flat gradient buffer, which backward accumulates into.

The reference is the same optimizer with flat_grads=False, bit for bit (the kernel and
its inputs are the same, only where the gradients live differs), and torch.optim.AdamW
within the optimizer-level tolerance for which parameters step and how. The flat and the
plain twin each run their own backward, on purpose: where backward writes is what is
tested, and theirs is the same computation (the same model, layout, dtype and parameter
bits), whose gradients are asserted the same bits (assert_same_grads); torch's twin steps
from copies of the plain twin's (Note [Twins share gradients] in tests/optim_harness.py). Gradients reach
the views the ways users reach them: backward (with accumulation), an in-place write,
and everything that replaces them (an assigned p.grad, p.grad = None,
model.zero_grad(), p.grad.data = ..., p.data = ...), which the step must notice.
"""

from __future__ import annotations

import copy
import pickle
import sys
import warnings

import pytest
import torch
from optim_harness import (
    CASE_IDS,
    CASES,
    EXACT,
    TORCH_DEFAULTS,
    VS_TORCH,
    CountOps,
    Net,
    assert_bitwise,
    assert_matches_torch,
    batch,
    copy_grads,
    make_torch,
    split_groups,
    uses_extra,
)
from torch import nn

import ruda_torch


def make(model: Net, case, flat: bool, **kwargs) -> ruda_torch.AdamW:
    g0, g1 = split_groups(model)
    groups = [{"params": g0}, {"params": g1, **case.group1}]
    return ruda_torch.AdamW(groups, **case.base, fused_step=True, flat_grads=flat, **kwargs)


def train_step(model: Net, opt, step: int, *, set_to_none: bool = True, micro: int = 1) -> None:
    """One iteration as a training loop writes it: zero_grad, backward (``micro``
    accumulated micro-batches), step."""
    opt.zero_grad(set_to_none=set_to_none)
    for k in range(micro):
        model.loss(batch(step) + k, uses_extra(step)).backward()
    opt.step()


def assert_same_grads(flat_model: Net, plain_model: Net, what: str = "") -> None:
    """The flat twin's gradients are the plain twin's bits, a view that backward did not
    reach (zeros) standing for a None gradient."""
    for j, (pf, pn) in enumerate(zip(flat_model.parameters(), plain_model.parameters(),
                                     strict=True)):  # fmt: skip
        if pn.grad is None:
            assert pf.grad is None or not pf.grad.view(torch.int32).any(), f"{what} grad {j}"
        else:
            assert_bitwise(pf.grad, pn.grad, f"{what} grad {j}")


def torch_step(source: Net, model: Net, opt) -> None:
    """torch's twin steps from copies of ``source``'s gradients."""
    opt.zero_grad()
    copy_grads(source, model)
    opt.step()


def assert_same(a: ruda_torch.AdamW, b: ruda_torch.AdamW, what: str = "") -> None:
    """Parameters and state of two optimizers over twin models, bit for bit."""
    assert_matches_torch(a, b, tol=EXACT, what=what)


def views_installed(opt) -> bool:
    return all(
        p.grad is v
        for b in opt._plan.buckets
        if b.flat
        for p, v in zip(b.params, b.grad_views, strict=True)
    )


# ------------------------------------------------------------------ the same steps


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_training_loop_matches_flat_grads_false_and_torch(case):
    """Ten iterations in which ``extra`` gets no gradient every third step: it is not
    stepped then (its view was not written since zero_grad), as torch skips a None
    gradient."""
    mf, mn, mt = Net(), Net(), Net()
    flat, plain, theirs = make(mf, case, True), make(mn, case, False), make_torch(mt, case)
    for step in range(1, 11):
        for model, opt in ((mf, flat), (mn, plain)):
            train_step(model, opt, step)
        assert_same_grads(mf, mn, f"step {step}")
        torch_step(mn, mt, theirs)
        assert_same(flat, plain, f"step {step}")
        assert_matches_torch(flat, theirs, VS_TORCH, f"step {step}")
        assert views_installed(flat)
    assert flat.state[mf.extra]["step"].item() == theirs.state[mt.extra]["step"].item() == 6


def test_zero_grad_keep_zeros_steps_every_parameter_as_torch():
    """zero_grad(set_to_none=False): torch keeps zero gradients, which step (moments
    decay, weight decay applies) even where backward wrote nothing; so do the views."""
    mf, mn, mt = Net(), Net(), Net()
    case = CASES[0]
    flat, plain, theirs = make(mf, case, True), make(mn, case, False), make_torch(mt, case)
    for step in range(1, 8):
        for model, opt in ((mf, flat), (mn, plain)):
            train_step(model, opt, step, set_to_none=False)
        assert_same_grads(mf, mn, f"step {step}")
        torch_step(mn, mt, theirs)  # zeros kept where plain's are, None where never made
        assert_matches_torch(flat, theirs, VS_TORCH, f"step {step}")
    # extra had no gradient at step 1 (never a tensor in torch: no state), then zeros.
    assert theirs.state[mt.extra]["step"].item() == flat.state[mf.extra]["step"].item() == 6


def test_gradient_accumulation_into_the_views():
    mf, mn = Net(), Net()
    case = CASES[2]  # AMSGrad
    flat, plain = make(mf, case, True), make(mn, case, False)
    for step in range(1, 7):
        train_step(mf, flat, step, micro=3)
        train_step(mn, plain, step, micro=3)
        assert_same_grads(mf, mn, f"step {step}")
        assert_same(flat, plain, f"step {step}")


def test_views_share_the_flat_buffer_and_survive_zero_grad():
    model = Net()
    opt = make(model, CASES[0], True)
    grads = {id(p): p.grad for p in model.parameters()}
    for b in opt._plan.buckets:
        for p, off in zip(b.params, b.offsets, strict=True):
            assert p.grad is not None and not p.grad.any(), "a zero view before backward"
            if p.numel():
                addr = b.grad_flat.data_ptr() + 4 * off
                assert p.grad.data_ptr() == addr
    model.loss(batch(1), True).backward()
    for p in model.parameters():
        assert p.grad is grads[id(p)], "backward accumulates into the view"
    b = opt._plan.buckets[0]
    assert b.grad_flat.abs().sum() > 0
    opt.step()
    opt.zero_grad()
    for p in model.parameters():
        assert p.grad is grads[id(p)] and not p.grad.any()


# ------------------------------------------------------------------ layouts and dtypes


def _layout_params(dtype: torch.dtype) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(3)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return [
        nn.Parameter(rnd(97)),
        nn.Parameter(rnd(1025)),
        nn.Parameter(rnd(65537)),
        nn.Parameter(rnd(0)),
        nn.Parameter(rnd(33, 7).t()),  # dense, not contiguous
        nn.Parameter(rnd(6, 10)[:, ::2]),  # not dense: stepped through a staging copy
        nn.Parameter(rnd(2, 3, 4, 5).to(memory_format=torch.channels_last)),
    ]


@pytest.mark.parametrize(
    "dtype,extra",
    [
        (torch.float32, {}),
        (torch.float32, dict(amsgrad=True, maximize=True)),
        (torch.float64, {}),
        (torch.bfloat16, {}),
        (torch.bfloat16, dict(master_weights=True)),
        (torch.bfloat16, dict(stochastic_rounding=True, rounding_seed=7)),
        (torch.float16, dict(master_weights=True)),
    ],
    ids=["fp32", "fp32-amsgrad-maximize", "fp64", "bf16", "bf16-master", "bf16-sr", "fp16-master"],
)
def test_layouts_and_dtypes_match_flat_grads_false(dtype, extra):
    """Leftover-loop sizes, zero-size, transposed, channels_last and non-dense parameters,
    every parameter dtype; fresh random gradients written into the views in place (as a
    user's hook would) against the same values assigned to the plain optimizer."""
    pf, pn = _layout_params(dtype), _layout_params(dtype)
    kw = dict(TORCH_DEFAULTS, fused_step=True, **extra)
    flat = ruda_torch.AdamW(pf, flat_grads=True, **kw)
    plain = ruda_torch.AdamW(pn, **kw)
    gen = torch.Generator().manual_seed(11)
    for step in range(4):
        flat.zero_grad()
        for j, (a, b) in enumerate(zip(pf, pn, strict=True)):
            if step == 2 and j == 1:  # one parameter without a gradient this step
                b.grad = None
                continue
            g = torch.randn(a.shape, generator=gen).to(dtype)
            a.grad.copy_(g)
            b.grad = g.clone()
        flat.step()
        plain.step()
        for j, (a, b) in enumerate(zip(pf, pn, strict=True)):
            assert torch.equal(a, b), f"step {step} parameter {j}"
            for key, value in plain.state[b].items():
                assert torch.equal(flat.state[a][key], value), f"step {step} param {j} {key}"
    assert flat.state[pf[1]]["step"].item() == 3


# ------------------------------------------------------------------ what replaces the views


def _pair(**kwargs):
    mf, mn = Net(), Net()
    return mf, mn, make(mf, CASES[0], True, **kwargs), make(mn, CASES[0], False, **kwargs)


def test_an_assigned_grad_is_stepped_and_readopted():
    mf, mn, flat, plain = _pair()
    for model, opt in ((mf, flat), (mn, plain)):
        train_step(model, opt, 1)
        opt.zero_grad()
        model.loss(batch(2), True).backward()
    g = torch.full_like(mf.fc1.weight, 0.25)
    mf.fc1.weight.grad = g
    mn.fc1.weight.grad = g.clone()
    mf.extra.grad = None  # as if backward had not reached it
    mn.extra.grad = None
    flat.step()
    plain.step()
    assert_same(flat, plain)
    assert views_installed(flat), "the replaced gradients are views again after the step"
    assert torch.equal(mf.fc1.weight.grad, g), "with the assigned values"
    assert not mf.extra.grad.any()
    assert not flat.state.get(mf.extra), "a None gradient was not stepped (no state yet)"
    for step in range(3, 6):  # and the next steps are the flat path again
        train_step(mf, flat, step)
        train_step(mn, plain, step)
        assert_same(flat, plain, f"step {step}")


def test_model_zero_grad_every_step_is_correct_and_warns_once():
    mf, mn, flat, plain = _pair()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, 6):
            for model, opt in ((mf, flat), (mn, plain)):
                model.zero_grad()  # set_to_none: backward makes new gradients
                model.loss(batch(step), uses_extra(step)).backward()
                opt.step()
            assert_same(flat, plain, f"step {step}")
    msgs = [str(w.message) for w in caught if "flat_grads=True" in str(w.message)]
    assert len(msgs) == 1 and "model.zero_grad()" in msgs[0], msgs
    # From the second step in a row on, the gradients are left where they are (no copy
    # back): the bucket steps as flat_grads=False would, until optimizer.zero_grad().
    assert not views_installed(flat)
    for step in range(6, 9):
        for model, opt in ((mf, flat), (mn, plain)):
            train_step(model, opt, step)
        assert_same(flat, plain, f"step {step}")
        assert views_installed(flat), "optimizer.zero_grad() put the views back"


def test_moved_view_and_moved_parameter_memory():
    """``p.grad.data = t`` keeps the view object and moves its memory; ``p.data = t``
    keeps the parameter and moves its memory. The step takes both where they are now."""
    mf, mn, flat, plain = _pair()
    for model, opt in ((mf, flat), (mn, plain)):
        train_step(model, opt, 1)
        opt.zero_grad()
        model.loss(batch(2), True).backward()
    moved = mf.fc2.weight.grad
    moved.data = torch.full_like(moved, -0.5)
    mn.fc2.weight.grad = torch.full_like(moved, -0.5)
    for model in (mf, mn):
        model.fc1.bias.data = model.fc1.bias.detach().clone() + 1.0
    flat.step()
    plain.step()
    assert_same(flat, plain)
    assert views_installed(flat)
    assert mf.fc2.weight.grad is not moved, "a new view replaced the moved one"
    for step in range(3, 6):
        train_step(mf, flat, step)
        train_step(mn, plain, step)
        assert_same(flat, plain, f"step {step}")


def test_add_param_group_and_toggled_options():
    mf, mn = Net(), Net()
    g0f, g1f = split_groups(mf)
    g0n, g1n = split_groups(mn)
    flat = ruda_torch.AdamW(g0f, **TORCH_DEFAULTS, fused_step=True, flat_grads=True)
    plain = ruda_torch.AdamW(g0n, **TORCH_DEFAULTS, fused_step=True)
    for step in range(1, 3):
        train_step(mf, flat, step)
        train_step(mn, plain, step)
    flat.add_param_group({"params": g1f, "amsgrad": True})
    plain.add_param_group({"params": g1n, "amsgrad": True})
    for step in range(3, 6):
        train_step(mf, flat, step)
        train_step(mn, plain, step)
        assert_same(flat, plain, f"step {step}")
    for opt in (flat, plain):
        opt.param_groups[1]["amsgrad"] = False  # the bucket keeps its AMSGrad buffer
    for step in range(6, 8):
        train_step(mf, flat, step)
        train_step(mn, plain, step)
        assert_same(flat, plain, f"step {step}")
    flat.param_groups[0]["flat_grads"] = False  # back to the gathered gradients
    train_step(mf, flat, 8)
    train_step(mn, plain, 8)
    assert_same(flat, plain)


def test_statistics_clipping_and_grad_scaler():
    kw = dict(hierarchical_stats=True, max_grad_norm=0.05)
    mf, mn, flat, plain = _pair(**kw)
    sf = ruda_torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    sn = ruda_torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    for step in range(1, 7):
        for model, opt, scaler in ((mf, flat, sf), (mn, plain, sn)):
            opt.zero_grad()
            loss = model.loss(batch(step), uses_extra(step))
            if step == 4:
                loss = loss * float("inf")  # a skipped step
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        assert_same(flat, plain, f"step {step}")
        assert torch.equal(flat.last_report.tensor, plain.last_report.tensor)
        assert sf.get_scale() == sn.get_scale()
    assert flat.state[mf.fc1.weight]["step"].item() == 5


def test_checkpoints_pickles_and_copies():
    mf, mn, flat, plain = _pair()
    for step in range(1, 4):
        train_step(mf, flat, step)
        train_step(mn, plain, step)
    sd = flat.state_dict()
    mf2 = copy.deepcopy(mf)
    resumed = make(mf2, CASES[0], True)
    resumed.load_state_dict(sd)
    copied = copy.deepcopy((mf, flat))
    pickled = pickle.loads(pickle.dumps((mf, flat)))
    runs = [(mf2, resumed), copied, pickled]
    for step in range(4, 7):
        train_step(mn, plain, step)
        for model, opt in runs:
            train_step(model, opt, step)
            assert_same(opt, plain, f"step {step}")
    for _, opt in runs:
        assert views_installed(opt)


# ------------------------------------------------------------------ host work and errors


def _step_work(n_params: int, flat: bool) -> tuple[int, int]:
    """(Python calls, dispatched torch operators) of one steady step (the second measured:
    the first one's calls include torch's lazy initializations)."""
    params = [nn.Parameter(torch.randn(7)) for _ in range(n_params)]
    opt = ruda_torch.AdamW(params, **TORCH_DEFAULTS, fused_step=True, flat_grads=flat)
    for _ in range(2):
        opt.zero_grad()
        for p in params:
            if flat:
                p.grad.add_(1.0)
            else:
                p.grad = torch.ones_like(p)
        opt.step()
    _measured(opt)
    return _measured(opt)


def _measured(opt) -> tuple[int, int]:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    counter = CountOps()
    sys.setprofile(profile)
    try:
        with counter:
            opt.step()
    finally:
        sys.setprofile(None)
    # (torch's optimizer wrapper records a profiler range: two operators on every path)
    return calls, sum(not str(op).startswith("profiler.") for op in counter.ops)


def test_host_work_per_step_does_not_grow_with_parameters():
    """With flat gradients a step is the same Python calls whatever the number of
    parameters, and dispatches no torch operator (no tensor lists built per step); the
    per-parameter work left is one C loop of address checks."""
    small, large = _step_work(10, True), _step_work(1000, True)
    assert small == large, (small, large)
    assert large[1] == 0, "the flat step calls the kernel through its handle"
    assert _step_work(10, False)[1] >= 1  # the gathered path dispatches the operator


def test_errors_name_the_option_and_what_to_do():
    p = nn.Parameter(torch.randn(3))
    with pytest.raises(ValueError, match="flat_grads require fused_step=True"):
        ruda_torch.AdamW([p], flat_grads=True)

    class Sub(nn.Parameter):
        pass

    with pytest.raises(ValueError, match="Sub.*flat_grads=False"):
        ruda_torch.AdamW([Sub(torch.randn(3))], fused_step=True, flat_grads=True)

    class FakeFlat(nn.Parameter):
        _is_flat_param = True

    with pytest.raises(ValueError, match="FlatParameter"):
        ruda_torch.AdamW([FakeFlat(torch.randn(3))], fused_step=True, flat_grads=True)
    opt = ruda_torch.AdamW([p], fused_step=True)
    with pytest.raises(ValueError, match="FlatParameter"):
        opt.add_param_group({"params": [FakeFlat(torch.randn(2))], "flat_grads": True})
    assert len(opt.param_groups) == 1


def test_meta_parameters_get_views_when_materialized():
    """An optimizer built on a meta model (accepted, as torch's fused path accepts it)
    installs no views; once its groups hold the materialized parameters, zero_grad()
    installs them."""
    with torch.device("meta"):
        model = nn.Linear(4, 3)
    opt = ruda_torch.AdamW(model.parameters(), **TORCH_DEFAULTS, fused_step=True, flat_grads=True)
    assert model.weight.grad is None
    model.to_empty(device="cpu")  # new Parameter objects
    opt.param_groups[0]["params"] = list(model.parameters())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    twin = copy.deepcopy(model)
    plain = ruda_torch.AdamW(twin.parameters(), **TORCH_DEFAULTS, fused_step=True)
    for step in range(3):
        for m, o in ((model, opt), (twin, plain)):
            o.zero_grad()
            m(torch.randn(2, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
            o.step()
        assert torch.equal(model.weight, twin.weight)
    assert views_installed(opt)


def test_invalid_state_zero_grad_resets_and_the_step_refuses():
    """zero_grad() never raises for a state the step will reject (as torch's does not);
    the step then raises before writing anything, and a valid state works again."""
    mf, mn, flat, plain = _pair()
    train_step(mf, flat, 1)
    train_step(mn, plain, 1)
    saved = flat.state[mf.fc1.weight]
    flat.state[mf.fc1.weight] = {"step": torch.tensor(1.0), "exp_avg": "not a tensor"}
    flat.zero_grad()
    mf.loss(batch(2), True).backward()
    before = [p.detach().clone() for p in mf.parameters()]
    with pytest.raises(ValueError, match="exp_avg"):
        flat.step()
    assert all(torch.equal(a, b) for a, b in zip(before, mf.parameters(), strict=True))
    flat.state[mf.fc1.weight] = saved
    flat.step()
    plain.zero_grad()
    mn.loss(batch(2), True).backward()
    plain.step()
    assert_same(flat, plain)
    assert views_installed(flat)
