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
    for m, o in ((mo, ours), (m4, o4)):
        backward(m, 9)
        o.step()
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
    opt.add_param_group({"params": [q], "fused": True})
    assert opt.param_groups[1]["fused_step"]
    # A group from torch round-trips its keywords.
    t = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], foreach=False, capturable=True)
    r = ruda_torch.AdamW([torch.nn.Parameter(torch.randn(3))])
    r.load_state_dict(t.state_dict())
    assert r.param_groups[0]["capturable"] and r.param_groups[0]["foreach"] is False
    t.load_state_dict(r.state_dict())
    assert t.param_groups[0]["capturable"]
    assert ruda_torch.Adam([p]).defaults["weight_decay"] == 0.0
