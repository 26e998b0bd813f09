"""ruda_torch.Adam against torch.optim.Adam, as tests/test_optimizer.py tests AdamW against
torch.optim.AdamW: the optimizer matrix (every configuration x the generic, fused and
mixed paths), the FP64 reference of the L2 update on sizes that hit every loop,
checkpoints both ways, ``decoupled_weight_decay=True`` as AdamW bit for bit, and the
options around the step (flat gradients, master weights, statistics and clipping); then
torch's constructor keywords of both classes (Note [Weight decay modes] in
csrc/adamw_math.h)."""

from __future__ import annotations

import copy
import inspect
import io
import re
from pathlib import Path

import pytest
import torch
from optim_harness import (
    CASE_IDS,
    CASES,
    EXACT,
    MODE_IDS,
    TORCH_DEFAULTS,
    VS_TORCH_CLIPPED,
    Case,
    Net,
    assert_bitwise,
    assert_matches_torch,
    backward,
    copy_grads,
    make_ours,
    make_torch,
    train_pairs,
    twin,
)

import ruda_torch
from ruda_torch import ops
from ruda_torch.reference import adamw_reference

DOCS = Path(__file__).resolve().parents[1] / "docs" / "usage.md"


def _pair(case: Case, mode: str, **kwargs):
    mo = Net()
    mt = twin(mo)
    ours = make_ours(mo, case, mode, cls=ruda_torch.Adam, **kwargs)
    theirs = make_torch(mt, case, cls=torch.optim.Adam, **kwargs)
    return mo, ours, mt, theirs


_train = train_pairs


@pytest.mark.parametrize("mode", MODE_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_trains_like_torch_adam(case, mode):
    """L2 weight decay goes through the moments: every configuration of the matrix (with
    weight decay in most of them) against torch.optim.Adam after every step."""
    mo, ours, mt, theirs = _pair(case, mode)
    for step in range(1, 11):
        backward(mo, step)
        copy_grads(mo, mt)
        ours.step()
        theirs.step()
        assert_matches_torch(ours, theirs, what=f"step {step}")
    assert all(not g["decoupled_weight_decay"] for g in ours.param_groups)


@pytest.mark.parametrize("mode", MODE_IDS)
def test_decoupled_weight_decay_is_adamw_bit_for_bit(mode):
    case = Case("decay", dict(TORCH_DEFAULTS, weight_decay=0.1, amsgrad=True))
    mo = Net()
    ma = twin(mo)
    adam = make_ours(mo, case, mode, cls=ruda_torch.Adam, decoupled_weight_decay=True)
    adamw = make_ours(ma, case, mode)
    mt = twin(mo)
    theirs = make_torch(mt, case, cls=torch.optim.Adam, decoupled_weight_decay=True)
    for step in range(1, 6):
        backward(mo, step)
        copy_grads(mo, ma)
        copy_grads(mo, mt)
        adam.step(), adamw.step(), theirs.step()
    for p, q in zip(mo.parameters(), ma.parameters(), strict=True):
        assert_bitwise(p, q)
    assert_matches_torch(adam, theirs)


# ------------------------------------------------------------------ the kernel against FP64


@pytest.mark.parametrize("n", [0, 1, 97, 1025, 65537])
@pytest.mark.parametrize("amsgrad, maximize", [(False, False), (True, True)])
def test_l2_kernel_against_fp64_reference(n, amsgrad, maximize):
    """The fused kernel with decoupled=False against the FP64 reference of the same
    algorithm, with a gradient scale and a clip coefficient; an unaligned view (offset 1)
    through the generic path's twin below. FP32 error bound: tests/tolerances.py."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n + 1, generator=gen)[1:]  # not 64-byte aligned
    g = torch.randn(n, generator=gen) * 4.0
    m = torch.randn(n, generator=gen) * 0.1
    v = torch.rand(n, generator=gen) * 0.01
    vmax = v + torch.rand(n, generator=gen) * 0.01
    steps = torch.tensor([6.0])
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.2)
    ref = adamw_reference(p, g, m, v, vmax, 6, **hp, amsgrad=amsgrad, maximize=maximize,
                          gradient_scale=4.0, clip_coef=0.5, decoupled=False)  # fmt: skip
    mine_p, mine_m, mine_v, mine_vm = p.clone(), m.clone(), v.clone(), vmax.clone()
    ops.adamw_scaled_(
        [mine_p], [g], mine_m, mine_v, mine_vm if amsgrad else None, steps,
        torch.tensor([[0, 0]], dtype=torch.int64), lr=hp["lr"], beta1=0.9, beta2=0.99,
        eps=1e-8, weight_decay=0.2, maximize=maximize, grad_scale=torch.tensor([4.0]),
        clip_coef=torch.tensor([0.5]), decoupled=False,
    )  # fmt: skip
    for got, want, what in ((mine_p, ref[0], "param"), (mine_m, ref[1], "exp_avg"),
                            (mine_v, ref[2], "exp_avg_sq")):  # fmt: skip
        # Error in FP32 ulps of the largest reference value (tests/tolerances.py's unit):
        # a handful of roundings per element, far below what a wrong formula gives.
        if n:
            units = (got.double() - want).abs().max() / (2.0**-23 * want.abs().max())
            assert units <= 16, f"{what}: {units:.3g} units from the FP64 reference"
    assert steps.item() == 7.0
    # And the decoupled reference differs: the mode is really applied.
    other = adamw_reference(p, g, m, v, vmax, 6, **hp, amsgrad=amsgrad, maximize=maximize,
                            gradient_scale=4.0, clip_coef=0.5)  # fmt: skip
    if n:
        assert not torch.allclose(other[1], ref[1])


def test_weight_decay_zero_is_the_same_update_in_both_modes():
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(1025, generator=gen), torch.randn(1025, generator=gen)
    p[0], p[1] = float("inf"), float("nan")  # `+ 0 * p` would turn these into NaN gradients
    outs = []
    for decoupled in (True, False):
        q, m, v, steps = p.clone(), torch.zeros(1025), torch.zeros(1025), torch.zeros(1)
        ops.adamw_scaled_([q], [g], m, v, None, steps, torch.tensor([[0, 0]]), lr=1e-3,
                          beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                          decoupled=decoupled)  # fmt: skip
        outs.append((q, m, v))
    for a, b in zip(*outs, strict=True):
        assert_bitwise(a, b)


# ------------------------------------------------------------------ checkpoints both ways


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("mode", MODE_IDS)
def test_checkpoints_both_ways_with_torch_adam(mode):
    case = Case("x", dict(TORCH_DEFAULTS, weight_decay=0.05, amsgrad=True))
    mo, ours, mt, theirs = _pair(case, mode)
    _train([(mo, ours, mt, theirs)], range(1, 4))
    # ours -> torch
    m2 = twin(mo)
    t2 = make_torch(m2, Case("fresh", TORCH_DEFAULTS), cls=torch.optim.Adam)
    t2.load_state_dict(_roundtrip(ours.state_dict()))
    assert all(not g["decoupled_weight_decay"] for g in t2.param_groups)
    assert_matches_torch(ours, t2, tol=EXACT, what="ours loaded into torch")
    # torch -> ours
    m3 = twin(mt)
    o3 = make_ours(m3, Case("fresh", dict(lr=0.1)), mode, cls=ruda_torch.Adam)
    o3.load_state_dict(_roundtrip(theirs.state_dict()))
    assert [g["weight_decay"] for g in o3.param_groups] == [0.05, 0.05]
    _train([(mo, ours, mt, theirs), (m3, o3, m2, t2)], range(4, 8))
    assert_matches_torch(ours, theirs)
    assert_matches_torch(o3, t2)
    # resume bit for bit
    m4 = twin(mo)
    o4 = make_ours(m4, case, mode, cls=ruda_torch.Adam)
    o4.load_state_dict(_roundtrip(ours.state_dict()))
    backward(mo, 9)
    copy_grads(mo, m4)
    ours.step()
    o4.step()
    for p, q in zip(mo.parameters(), m4.parameters(), strict=True):
        assert_bitwise(p, q)


# ------------------------------------------------------------------ options around the step


def test_statistics_clipping_flat_grads_and_master_weights():
    """Adam with flat gradients, the statistics and max_grad_norm against torch.optim.Adam
    after clip_grad_norm_; BF16 parameters with master weights against the FP32 run."""
    case = Case("x", dict(TORCH_DEFAULTS, weight_decay=0.1))
    mo = Net()
    mt = twin(mo)
    ours = make_ours(mo, case, "fused", cls=ruda_torch.Adam, flat_grads=True,
                     hierarchical_stats=True, max_grad_norm=0.5)  # fmt: skip
    theirs = make_torch(mt, case, cls=torch.optim.Adam)
    for step in range(1, 6):
        ours.zero_grad()
        mo.loss(torch.randn(8, 6, generator=torch.Generator().manual_seed(step)),
                True).backward()  # fmt: skip
        copy_grads(mo, mt)
        torch.nn.utils.clip_grad_norm_(mt.parameters(), 0.5)
        ours.step()
        theirs.step()
        assert ours.last_report.clip_coef.item() < 1.0
        assert_matches_torch(ours, theirs, tol=VS_TORCH_CLIPPED, what=f"step {step}")

    torch.manual_seed(0)
    fp32 = torch.nn.Linear(64, 64)
    with torch.no_grad():  # BF16 values: the masters start from exactly these
        for p in fp32.parameters():
            p.copy_(p.bfloat16().float())
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    a = ruda_torch.Adam(fp32.parameters(), lr=1e-3, weight_decay=0.1, fused_step=True)
    b = ruda_torch.Adam(bf16.parameters(), lr=1e-3, weight_decay=0.1, fused_step=True,
                        master_weights=True)  # fmt: skip
    for _ in range(3):
        for p, q in zip(fp32.parameters(), bf16.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.to(torch.bfloat16).float().to(torch.bfloat16)
            p.grad = q.grad.float()
        a.step(), b.step()
    for p, q in zip(fp32.parameters(), bf16.parameters(), strict=True):
        # The masters follow the FP32 run on the same (BF16-valued) gradients exactly.
        assert_bitwise(b.state[q]["master_param"], p.detach())


# ------------------------------------------------------------------ torch's keywords


@pytest.mark.parametrize(
    "ours, theirs",
    [(ruda_torch.AdamW, torch.optim.AdamW), (ruda_torch.Adam, torch.optim.Adam)],
    ids=["AdamW", "Adam"],
)
def test_every_torch_keyword_is_accepted_and_documented(ours, theirs):
    """Fails when torch gains a keyword we do not handle: each is in our signature and in
    the keyword table of docs/usage.md."""
    mine = inspect.signature(ours.__init__).parameters
    table = DOCS.read_text()
    for name, param in inspect.signature(theirs.__init__).parameters.items():
        if name in ("self", "params"):
            continue
        if name not in mine and "options" not in mine:
            pytest.fail(f"{ours.__name__} does not take torch's keyword {name!r}")
        assert re.search(rf"^\| `{name}` \|", table, re.M), f"{name} is not in usage.md's table"
        value = param.default
        if name == "differentiable":
            value = False
        opt = ours([torch.nn.Parameter(torch.randn(3))], **{name: value})
        assert opt.param_groups[0][name] == value or name == "betas", name


def test_keyword_meanings():
    p = torch.nn.Parameter(torch.randn(3))
    fused = ruda_torch.AdamW([p], fused=True)
    assert fused.param_groups[0]["fused_step"] and fused.param_groups[0]["fused"]
    assert not ruda_torch.AdamW([p], fused=False).param_groups[0]["fused_step"]
    with pytest.raises(ValueError, match="fused=True and fused_step=False disagree"):
        ruda_torch.AdamW([p], fused=True, fused_step=False)
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        ruda_torch.Adam([p], differentiable=True)
    with pytest.raises(ValueError, match=r"differentiable=True is not supported \(param group"):
        ruda_torch.AdamW([{"params": [p], "differentiable": True}])
    opt = ruda_torch.AdamW([p], foreach=True, capturable=True)
    assert opt.param_groups[0]["foreach"] and opt.param_groups[0]["capturable"]
    q = torch.nn.Parameter(torch.randn(3))
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        opt.add_param_group({"params": [q], "fused": True})  # foreach=True from the defaults
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [q], "fused": True, "foreach": None})
    assert opt.param_groups[1]["fused_step"]
    # A group from torch round-trips its keywords.
    t = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], foreach=False, capturable=True)
    r = ruda_torch.AdamW([torch.nn.Parameter(torch.randn(3))])
    r.load_state_dict(t.state_dict())
    assert r.param_groups[0]["capturable"] and r.param_groups[0]["foreach"] is False
    t.load_state_dict(r.state_dict())
    assert t.param_groups[0]["capturable"]
    assert ruda_torch.Adam([p]).defaults["weight_decay"] == 0.0


# torch's own error inputs for its optimizers (optim_db's optim_error_inputs_func) and the two
# it gives only on CUDA devices, with CPU tensors: what torch refuses at construction.
common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")
_FUSED_ERRORS = [
    ({"foreach": True, "fused": True}, RuntimeError, "`fused` and `foreach` cannot be `True` together"),
    ({"fused": True, "differentiable": True}, RuntimeError, "`fused` does not support `differentiable`"),
]  # fmt: skip


def _torch_error_inputs(theirs):
    info = next(o for o in common_optimizers.optim_db if o.optim_cls is theirs)
    out = []
    for ei in info.optim_error_inputs_func(device="cpu", dtype=torch.float32):
        oi = ei.optimizer_error_input
        out.append((oi.params, oi.kwargs, ei.error_type, ei.error_regex, ei.error_on))
    construction = common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR
    out += [(None, kw, kind, regex, construction) for kw, kind, regex in _FUSED_ERRORS]
    return out


@pytest.mark.parametrize(
    "ours, theirs",
    [(ruda_torch.AdamW, torch.optim.AdamW), (ruda_torch.Adam, torch.optim.Adam)],
    ids=["AdamW", "Adam"],
)
def test_torch_error_inputs_raise_torchs_errors(ours, theirs):
    """Every error input torch's optimizer test suite gives Adam and AdamW raises the same
    kind of error with torch's words, here as in torch (both are run)."""
    cases = _torch_error_inputs(theirs)
    assert len(cases) >= 10
    for params, kwargs, kind, regex, when in cases:
        assert when == common_optimizers.OptimizerErrorEnum.CONSTRUCTION_ERROR
        for cls in (theirs, ours):
            ps = params if params is not None else [torch.nn.Parameter(torch.randn(2))]
            kw = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            if issubclass(kind, Warning):
                with pytest.warns(kind, match=regex):
                    cls(ps, **kw)
            else:
                with pytest.raises(kind, match=regex):
                    cls(ps, **kw)


# The conflicts of torch's keywords as group values, and the error each place raises: torch
# refuses them in its constructor or at its step; here also where a group is added or loaded.
_CONFLICTS = {
    "fused+foreach": ({"fused": True, "fused_step": True, "foreach": True}, RuntimeError,
                      "`fused` and `foreach` cannot be `True` together"),
    "fused+differentiable": ({"fused": True, "fused_step": True, "differentiable": True},
                             RuntimeError, "`fused` does not support `differentiable`"),
    "fused_step+differentiable": ({"fused_step": True, "differentiable": True}, RuntimeError,
                                  "`fused` does not support `differentiable`"),
    "differentiable": ({"differentiable": True}, ValueError, "differentiable=True is not supported"),
    "tensor-lr+foreach": ({"lr": torch.tensor(1e-3), "foreach": True}, RuntimeError,
                          "lr as a Tensor is not supported for capturable=False and foreach=True"),
    "fused-disagrees": ({"fused": True, "fused_step": False}, ValueError,
                        "fused=True and fused_step=False disagree"),
}  # fmt: skip


def _stepped(cls, fused_step):
    gen = torch.Generator().manual_seed(4)
    ps = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)) for _ in range(2)]
    opt = cls([{"params": [ps[0]]}, {"params": [ps[1]]}], lr=1e-2, fused_step=fused_step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return opt, ps


def _snapshot(opt, ps):
    return ([p.detach().clone() for p in ps], copy.deepcopy(opt.state_dict()))


def _unchanged(opt, ps, snap):
    before_params, before = snap
    assert all(torch.equal(p, q) for p, q in zip(ps, before_params, strict=True))
    after = opt.state_dict()
    assert len(after["param_groups"]) == len(before["param_groups"])
    for g, h in zip(after["param_groups"], before["param_groups"], strict=True):
        assert set(g) == set(h)
        for k in g:
            assert g[k] == h[k] if not isinstance(g[k], torch.Tensor) else torch.equal(g[k], h[k])
    for key, st in before["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][key][k], v), k


@pytest.mark.parametrize("cls", [ruda_torch.AdamW, ruda_torch.Adam], ids=["AdamW", "Adam"])
@pytest.mark.parametrize("conflict", list(_CONFLICTS), ids=str)
@pytest.mark.parametrize("where", ["construction", "add_param_group", "load", "between-steps"])
def test_keyword_conflicts_are_refused_everywhere_before_any_write(cls, conflict, where):
    """Each conflict of torch's keywords, wherever a group gets it: refused with torch's kind
    of error (its constructor's at construction, its step's elsewhere) before anything is
    written; the optimizer steps on once the group is put right."""
    values, kind, regex = _CONFLICTS[conflict]
    fused_step = bool(values.get("fused_step", values.get("fused", False)))
    if where == "construction":
        if conflict == "tensor-lr+foreach":
            kind = ValueError  # torch's constructor raises ValueError for this one
        with pytest.raises(kind, match=regex):
            cls([torch.nn.Parameter(torch.randn(3))], **values)
        return
    opt, ps = _stepped(cls, fused_step)
    snap = _snapshot(opt, ps)
    if where == "add_param_group":
        extra = torch.nn.Parameter(torch.randn(4))
        with pytest.raises(kind, match=regex):
            opt.add_param_group({"params": [extra], **values})
        _unchanged(opt, ps, snap)
        return
    if where == "load":
        sd = copy.deepcopy(opt.state_dict())
        sd["param_groups"][1].update(values)
        with pytest.raises(kind, match=regex):
            opt.load_state_dict(sd)
        _unchanged(opt, ps, snap)
        return
    saved = {k: opt.param_groups[1][k] for k in values}
    opt.param_groups[1].update(values)
    for p in ps:
        p.grad = torch.randn_like(p)
    with pytest.raises(kind, match=regex):
        opt.step()
    opt.param_groups[1].update(saved)
    _unchanged(opt, ps, snap)
    opt.step()  # put right, it steps
    assert not torch.equal(ps[0], snap[0][0])


def test_fused_changed_between_steps_is_an_error_not_ignored():
    """group["fused"] = True on a generic group: an error naming both settings (the group
    would otherwise stay generic while saying fused=True); setting both switches the path."""
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = ruda_torch.AdamW([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.param_groups[0]["fused"] = True
    with pytest.raises(ValueError, match="fused=True and fused_step=False disagree"):
        opt.step()
    opt.param_groups[0]["fused_step"] = True
    opt.step()
    assert opt._plan is not None and opt._plan.groups  # the fused path now


def test_torch_checkpoint_fused_keeps_this_optimizers_path():
    """A torch checkpoint's `fused` names torch's path: loaded, the group keeps ours
    (fused_step) and a coherent `fused`."""
    p = torch.nn.Parameter(torch.randn(3))
    t = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], fused=False)
    ours = ruda_torch.AdamW([p], fused_step=True)
    ours.load_state_dict(t.state_dict())
    g = ours.param_groups[0]
    assert g["fused_step"] and g["fused"] is None
    p.grad = torch.randn_like(p)
    ours.step()
