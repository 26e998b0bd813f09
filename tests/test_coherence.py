"""optimizer.state and param_groups are the truth (Note [Fused state coherence], Note
[Atomic step]).

Every legal mutation a torch user or tool makes to a stepped optimizer is made, by the same
calls, to ``ruda_torch.AdamW`` and to ``torch.optim.AdamW``; both then keep training on
identical gradients. Ours must match torch (Note [Optimizer-level tolerance]: the two
evaluate the same formula in different orders) and, bit for bit, a fresh ruda_torch
optimizer built from what ours reports right after the mutation (its parameters and
``state_dict()``): that is what shows the mutation was honoured and not merely survived.
Every illegal one must raise, change nothing (parameters, gradients, every state tensor,
the groups), and leave an optimizer that then steps exactly like a twin that never saw it.

Parameters: sizes that hit the kernels' leftover loops (97, 1025), a matrix, a zero-size
one, one that sits out every third step, in two param groups.
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from optim_harness import (
    VS_TORCH,
    assert_bitwise,
    assert_bitwise_twins,
    assert_matches_torch,
    assert_same_snapshot,
    copy_grads,
    snapshot,
)
from threads import num_threads
from torch import nn

import ruda_torch

SHAPES = [[(97,), (4, 5), (1025,)], [(16,), (0,), (6,), (16,)]]
SITS_OUT = (1, 2)  # (group, position): no gradient at steps 1, 4, 7, ...
HYPER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
MODES = {"fused": (True, True), "mixed": (True, False), "generic": (False, False)}


@pytest.fixture(autouse=True)
def _one_thread():
    with num_threads(1):
        yield


def rand(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def make_params(seed: int = 0) -> list[list[nn.Parameter]]:
    return [
        [nn.Parameter(rand(s, seed + 10 * gi + j)) for j, s in enumerate(shapes)]
        for gi, shapes in enumerate(SHAPES)
    ]


def groups_of(params, mode: str, **extra) -> list[dict]:
    flags = MODES[mode]
    return [
        {"params": ps, **({"fused_step": flags[gi]} if mode else {}), **extra}
        for gi, ps in enumerate(params)
    ]


def make_ours(params, mode: str, amsgrad: bool = False, **kwargs) -> ruda_torch.AdamW:
    return ruda_torch.AdamW(
        groups_of(params, mode), **HYPER, amsgrad=amsgrad, fused_step=MODES[mode][0], **kwargs
    )


def make_torch(params, amsgrad: bool = False) -> torch.optim.AdamW:
    groups = [{"params": ps} for ps in params]
    return torch.optim.AdamW(groups, **HYPER, amsgrad=amsgrad, foreach=False)


def set_grads(opt, step: int) -> None:
    """The same gradients, by group and position, for every optimizer of a test."""
    for gi, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            sits_out = (gi, j) == SITS_OUT and step % 3 == 1
            g = rand(p.shape, 1000 * step + 10 * gi + j) * 0.3
            p.grad = None if sits_out else g.to(p.dtype)


def step_all(opts, step: int) -> None:
    for opt in opts:
        set_grads(opt, step)
        opt.step()


def rebuilt_from(ours: ruda_torch.AdamW) -> ruda_torch.AdamW:
    """A fresh ruda_torch optimizer over copies of ours' parameters, loaded from ours'
    state_dict(): what ours says its state is."""
    params = [[nn.Parameter(p.detach().clone()) for p in g["params"]] for g in ours.param_groups]
    ref = ruda_torch.AdamW(
        [{"params": ps} for ps in params],
        fused_step=bool(ours.param_groups[0]["fused_step"]),
        hierarchical_stats=ours.hierarchical_stats,
        max_grad_norm=ours.max_grad_norm,
    )
    ref.load_state_dict(copy.deepcopy(ours.state_dict()))
    return ref


# --------------------------------------------------------------------------- mutations
# Each takes an optimizer (ours or torch's) and makes the change by the calls a user or
# a tool makes; tensors come from seeds, so both sides get the same values.


def _p(opt, gi, j):
    return opt.param_groups[gi]["params"][j]


def _clear(opt):
    opt.state.clear()


def _new_mapping(opt):
    opt.state = defaultdict(dict)


def _reset_entry(opt):
    opt.state[_p(opt, 0, 2)] = {}


def _delete_entry(opt):
    del opt.state[_p(opt, 0, 0)]


def _pop_entry(opt):
    opt.state.pop(_p(opt, 1, 0))


def _replace_moment(opt):
    p = _p(opt, 0, 0)
    opt.state[p]["exp_avg"] = rand(p.shape, 7) * 0.01


def _replace_second_moment(opt):
    p = _p(opt, 0, 2)
    opt.state[p]["exp_avg_sq"] = rand(p.shape, 8).abs() * 1e-3


def _replace_step(opt):
    opt.state[_p(opt, 1, 3)]["step"] = torch.tensor(7.0)


def _integer_steps(opt):
    """Steps as int64 tensors (hand-made state; torch takes them, not Python ints)."""
    opt.state[_p(opt, 0, 0)]["step"] = torch.tensor(6, dtype=torch.int64)
    opt.state[_p(opt, 1, 0)]["step"] = torch.tensor(5, dtype=torch.int64)


def _inplace_writes(opt):
    opt.state[_p(opt, 0, 1)]["exp_avg_sq"].mul_(2.0)
    opt.state[_p(opt, 0, 2)]["step"].fill_(11.0)


def _move_state_through_data(opt):
    """The popular `optimizer_to(device)` recipe: `t.data = t.data.to(...)` on every state
    tensor (here a scaled copy, so that a state left behind shows)."""
    for st in opt.state.values():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                v.data = v.data * (1.25 if k != "step" else 1.0) + (1.0 if k == "step" else 0.0)


def _replace_entry(opt):
    p = _p(opt, 1, 2)
    opt.state[p] = {
        "step": torch.tensor(3.0),
        "exp_avg": rand(p.shape, 9) * 0.01,
        "exp_avg_sq": rand(p.shape, 10).abs() * 1e-4,
    }
    if opt.param_groups[1]["amsgrad"]:
        opt.state[p]["max_exp_avg_sq"] = rand(p.shape, 17).abs() * 1e-4


def _swap_entries(opt):
    a, b = _p(opt, 1, 0), _p(opt, 1, 3)  # both (16,)
    opt.state[a], opt.state[b] = opt.state[b], opt.state[a]


def _zero_style_load(opt):
    """What ZeroRedundancyOptimizer.load_state_dict does to its local optimizer: assign
    copies of the checkpoint's entries, then put 0-dim tensors (the step) on the CPU."""
    for gi in (0, 1):
        for p in opt.param_groups[gi]["params"]:
            if p in opt.state and opt.state[p]:
                opt.state[p] = {
                    k: (v * 1.5 if k != "step" else v + 2) for k, v in opt.state[p].items()
                }
                for k, v in opt.state[p].items():
                    if v.dim() == 0:
                        opt.state[p][k] = v.cpu()


# A parameter leaving the groups takes its state with it: torch's own state_dict() (and
# torch.distributed.checkpoint) fail on state of a tensor that is in no group.


def _replace_param(opt):
    opt.state.pop(_p(opt, 0, 1), None)
    opt.param_groups[0]["params"][1] = nn.Parameter(rand((4, 5), 11))


def _replace_param_other_shape(opt):
    opt.state.pop(_p(opt, 0, 1), None)
    opt.param_groups[0]["params"][1] = nn.Parameter(rand((33,), 12))


def _append_param(opt):
    opt.param_groups[0]["params"].append(nn.Parameter(rand((40,), 13)))


def _remove_param(opt):
    opt.state.pop(opt.param_groups[0]["params"].pop(0), None)


def _reorder_params(opt):
    group = opt.param_groups[1]
    group["params"] = list(reversed(group["params"]))


def _new_group_dict(opt):
    opt.param_groups.append({**opt.param_groups[1], "params": [nn.Parameter(rand((9,), 14))]})


def _delete_group(opt):
    for p in opt.param_groups.pop(0)["params"]:
        opt.state.pop(p, None)


def _new_storage(opt):
    p = _p(opt, 0, 2)
    p.data = rand(p.shape, 15)


def _new_layout(opt):
    """The same values in another memory order (a transposed layout, same shape): the
    state slot must follow the parameter's memory order (Note [Dense layouts])."""
    p = _p(opt, 0, 1)
    p.data = p.data.t().contiguous().t()
    assert not p.is_contiguous()


def _new_dtype_fresh_state(opt):
    """A parameter made FP64 and started afresh: its bucket gets FP64 state."""
    p = _p(opt, 0, 2)
    p.data = p.data.double()
    opt.state.pop(p, None)


def _resize_param_without_state(opt):
    """A parameter that has no state yet may change shape (torch starts it afresh)."""
    p = _p(opt, 1, 2)
    opt.state.pop(p, None)
    p.data = rand((50,), 16)


def _toggle_fused(opt):
    for g in opt.param_groups:
        g["fused_step"] = not g.get("fused_step", False)


def _load_torch_checkpoint(opt):
    params = make_params(seed=5)
    other = make_torch(params)
    for step in range(1, 4):
        set_grads(other, step)
        other.step()
    opt.load_state_dict(copy.deepcopy(other.state_dict()))


def _huge_step(opt):
    """A counter far beyond 2^63 (bias corrections are exactly 1 there)."""
    opt.state[_p(opt, 0, 0)]["step"] = torch.tensor(2.0**70)


MUTATIONS = {
    "state.clear": _clear,
    "state=defaultdict": _new_mapping,
    "state[p]={}": _reset_entry,
    "del state[p]": _delete_entry,
    "state.pop(p)": _pop_entry,
    "replace exp_avg": _replace_moment,
    "replace exp_avg_sq": _replace_second_moment,
    "replace step": _replace_step,
    "integer steps": _integer_steps,
    "in-place writes": _inplace_writes,
    "state tensors' .data moved": _move_state_through_data,
    "replace entry": _replace_entry,
    "swap entries": _swap_entries,
    "ZeRO-style load": _zero_style_load,
    "replace param": _replace_param,
    "replace param, other shape": _replace_param_other_shape,
    "append param": _append_param,
    "remove param": _remove_param,
    "reorder params": _reorder_params,
    "new group dict": _new_group_dict,
    "delete group": _delete_group,
    "p.data, same shape": _new_storage,
    "p.data, other layout": _new_layout,
    "p.data FP64, fresh state": _new_dtype_fresh_state,
    "resize param without state": _resize_param_without_state,
    "toggle fused_step": _toggle_fused,
    "load torch checkpoint": _load_torch_checkpoint,
    "step 2^70": _huge_step,
}


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_honoured_like_torch(name, mode, amsgrad):
    ours = make_ours(make_params(), mode, amsgrad)
    theirs = make_torch(make_params(), amsgrad)
    for step in (1, 2, 3):
        step_all((ours, theirs), step)
    MUTATIONS[name](ours)
    MUTATIONS[name](theirs)
    ref = rebuilt_from(ours)
    for step in (4, 5, 6, 7):
        step_all((ours, theirs, ref), step)
        assert_bitwise_twins(ours, ref, f"{name}: step {step} vs the state_dict() it reported")
        assert_matches_torch(ours, theirs, VS_TORCH, f"{name}: step {step}")
        for g in ours.param_groups:
            for p in g["params"]:
                assert torch.isfinite(p).all()


@pytest.mark.parametrize("mode", ["fused", "mixed"])
def test_state_dict_describes_the_buffers_the_kernel_steps(mode):
    """After a mutation the state views are what the kernel writes: stepping changes
    exactly the tensors optimizer.state holds."""
    ours = make_ours(make_params(), mode)
    step_all((ours,), 1)
    _replace_moment(ours)
    p = _p(ours, 0, 0)
    set_grads(ours, 2)
    ours.step()
    held = ours.state[p]["exp_avg"]
    before = held.clone()
    set_grads(ours, 3)
    ours.step()
    assert not torch.equal(held, before), "optimizer.state holds a tensor the step no longer writes"


# --------------------------------------------------------------------------- rejections


def _resize_with_state(opt, model_side):
    p = _p(opt, 0, 0)
    p.data = rand((120,), 20)


def _grow_within_padding(opt, model_side):
    p = _p(opt, 0, 0)  # 97 elements: its slot is padded to 112
    p.data = rand((100,), 21)


def _shrink_with_state(opt, model_side):
    p = _p(opt, 0, 2)
    p.data = rand((1000,), 22)


def _reshape_with_state(opt, model_side):
    p = _p(opt, 0, 1)
    p.data = p.data.reshape(5, 4).clone()


# torch refuses `p.grad = t` of another shape; `p.grad.data = t` gets through.
def _broadcastable_grad(opt, model_side):
    _p(opt, 1, 3).grad.data = torch.ones(1)


def _broadcastable_grad_group0(opt, model_side):
    _p(opt, 0, 0).grad.data = torch.ones(1)


def _float64_grad_last_group(opt, model_side):
    p = _p(opt, 1, 0)
    p.grad_dtype = None  # torch's switch for gradients of another dtype
    p.grad = p.grad.double()


def _half_grad_splits_bucket_then_bad(opt, model_side):
    """Two kernel calls for group 0 (FP16 and FP32 gradients), the bad one in group 1."""
    _p(opt, 0, 0).grad_dtype = None
    _p(opt, 0, 0).grad = _p(opt, 0, 0).grad.half()
    _p(opt, 1, 3).grad.data = torch.ones(2, 8)


def _missing_keys(opt, model_side):
    opt.state[_p(opt, 1, 0)] = {"exp_avg": torch.zeros(16)}


def _entry_wrong_shape(opt, model_side):
    p = _p(opt, 0, 2)
    opt.state[p] = {**opt.state[p], "exp_avg": torch.zeros(3)}


def _bad_step(value):
    def mutate(opt, model_side):
        opt.state[_p(opt, 1, 3)]["step"] = value

    return mutate


def _duplicate_param(opt, model_side):
    opt.param_groups[0]["params"].append(opt.param_groups[0]["params"][0])


def _param_in_two_groups(opt, model_side):
    opt.param_groups[1]["params"].append(opt.param_groups[0]["params"][0])


def _sparse_grad_last_group(opt, model_side):
    p = _p(opt, 1, 0)
    p.grad = p.grad.to_sparse()


def _integer_param_generic(opt, model_side):
    t = torch.arange(6)
    t.grad = torch.ones(6, dtype=torch.int64)
    opt.param_groups[1]["params"].append(t)


# (mutation, modes it applies to, error type, message)
REJECTIONS = {
    "resize param with state": (_resize_with_state, ("fused", "mixed"), ValueError, "shape"),
    "grow param within its padding": (
        _grow_within_padding, ("fused", "mixed"), ValueError, "shape"
    ),
    "shrink param with state": (_shrink_with_state, ("fused", "mixed"), ValueError, "shape"),
    "reshape param with state": (_reshape_with_state, ("fused", "mixed"), ValueError, "shape"),
    "broadcastable grad (generic)": (_broadcastable_grad, ("mixed", "generic"), ValueError, "shape"),
    "broadcastable grad (fused)": (_broadcastable_grad, ("fused",), RuntimeError, "same shape"),
    "broadcastable grad group 0": (
        _broadcastable_grad_group0, ("fused", "mixed"), RuntimeError, "same shape"
    ),
    "float64 grad in the last group": (
        _float64_grad_last_group, ("fused",), RuntimeError, "float32, float16 or bfloat16"
    ),
    "split bucket, then a bad grad": (
        _half_grad_splits_bucket_then_bad, ("fused",), RuntimeError, "same shape"
    ),
    "entry without its keys": (_missing_keys, tuple(MODES), ValueError, "lacks"),
    "entry of another shape": (_entry_wrong_shape, tuple(MODES), ValueError, "shape"),
    "step -1": (_bad_step(torch.tensor(-1.0)), ("fused",), ValueError, "non-negative integer"),
    "step 2.5": (_bad_step(torch.tensor(2.5)), ("fused",), ValueError, "non-negative integer"),
    "step nan": (_bad_step(torch.tensor(math.nan)), ("fused",), ValueError, "non-negative"),
    "step inf": (_bad_step(math.inf), tuple(MODES), ValueError, "non-negative integer"),
    "step None": (_bad_step(None), tuple(MODES), ValueError, "must be a number"),
    "step str": (_bad_step("3"), tuple(MODES), ValueError, "must be a number"),
    "step list": (_bad_step([3]), tuple(MODES), ValueError, "must be a number"),
    "step meta": (_bad_step(torch.tensor(3.0, device="meta")), tuple(MODES), ValueError, "meta"),
    "duplicate param": (_duplicate_param, ("fused", "mixed"), ValueError, "twice"),
    "param in two groups": (_param_in_two_groups, ("fused",), ValueError, "param groups 0 and 1"),
    "sparse grad in the last group": (
        _sparse_grad_last_group, ("fused", "mixed", "generic"), RuntimeError, "sparse"
    ),
    "integer param (generic)": (
        _integer_param_generic, ("mixed", "generic"), ValueError, "floating or complex"
    ),
}  # fmt: skip

# With hierarchical_stats + max_grad_norm too (statistics and clipping run before the
# updates), where every group is fused.
REJECTION_PARAMS = [
    pytest.param(name, mode, stats, id=f"{name}-{mode}{'-stats-clip' if stats else ''}")
    for name, (_, modes, _, _) in REJECTIONS.items()
    for mode in modes
    for stats in ((False, True) if mode == "fused" else (False,))
]


def _snapshot(opt) -> dict:
    """snapshot() that also takes state values a bad mutation left: non-tensors and meta
    tensors are kept by identity."""
    snap = {}
    for gi, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            st = opt.state.get(p)
            snap[gi, j] = (
                p.detach().clone(),
                None
                if st is None
                else {
                    k: v.detach().clone() if isinstance(v, torch.Tensor) and not v.is_meta else v
                    for k, v in st.items()
                },
            )
    return snap


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        (pa, sa), (pb, sb) = a[key], b[key]
        assert_bitwise(pa, pb, f"{what} param {key}")
        assert (sa is None) == (sb is None) and (sa is None or sa.keys() == sb.keys()), what
        for k in sa or {}:
            va, vb = sa[k], sb[k]
            if isinstance(va, torch.Tensor) and not va.is_meta:
                assert_bitwise(va, vb, f"{what} state {key} {k}")
            else:
                assert va is vb, f"{what} state {key} {k}"


def _grads(opt) -> list:
    return [
        None if p.grad is None else p.grad.detach().clone().to_dense()
        for g in opt.param_groups
        for p in g["params"]
    ]


def _torch_step(theirs, step: int, clip) -> None:
    set_grads(theirs, step)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for g in theirs.param_groups for p in g["params"]], clip)
    theirs.step()


@pytest.mark.parametrize("name, mode, stats", REJECTION_PARAMS)
def test_rejected_mutation_changes_nothing(name, mode, stats):
    mutate, _, error, message = REJECTIONS[name]
    kwargs = dict(hierarchical_stats=True, max_grad_norm=0.5) if stats else {}
    params, twin_params = make_params(), make_params()
    ours, twin = make_ours(params, mode, **kwargs), make_ours(twin_params, mode, **kwargs)
    theirs = make_torch(make_params())
    for step in (1, 2, 3):
        step_all((ours, twin), step)
        _torch_step(theirs, step, clip=0.5 if stats else None)
    # Step 4 with the bad input: it fails before anything is written.
    set_grads(ours, 4)
    saved = [(p, p.data) for g in ours.param_groups for p in g["params"]]
    groups = [(dict(g), list(g["params"])) for g in ours.param_groups]
    state_keys = {id(p): dict(st) for p, st in ours.state.items()}
    mutate(ours, "ours")
    before, grads = _snapshot(ours), _grads(ours)
    with pytest.raises(error, match=message):
        ours.step()
    _assert_same(before, _snapshot(ours), f"{name}: after the rejected step")
    after = _grads(ours)
    for a, b in zip(grads, after, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), "a grad changed"
    # Undo the bad input; the optimizer then steps exactly like its twin, and like torch.
    for p, data in saved:
        p.data = data
    for g, (saved_g, saved_params) in zip(ours.param_groups, groups, strict=True):
        g["params"][:] = saved_params
        assert {k: v for k, v in g.items() if k != "params"} == {
            k: v for k, v in saved_g.items() if k != "params"
        }
    for p in list(ours.state):
        if id(p) in state_keys:
            ours.state[p].clear()
            ours.state[p].update(state_keys[id(p)])
    for step in (4, 5, 6):
        step_all((ours, twin), step)
        _torch_step(theirs, step, clip=0.5 if stats else None)
        assert_bitwise_twins(ours, twin, f"{name}: step {step} after the rejected one")
        assert_matches_torch(ours, theirs, VS_TORCH, f"{name}: step {step}")


def test_failed_first_step_leaves_no_state():
    """A first step that fails in a later group creates no state entries."""
    params = make_params()
    ours = make_ours(params, "fused")
    set_grads(ours, 2)
    _p(ours, 1, 3).grad.data = torch.ones(3)
    with pytest.raises(RuntimeError, match="same shape"):
        ours.step()
    assert not any(ours.state.values())


# --------------------------------------------------------------------------- loads


def _sd_with_step(value):
    params = make_params()
    theirs = make_torch(params)
    step_all((theirs,), 1)
    sd = copy.deepcopy(theirs.state_dict())
    sd["state"][0]["step"] = value
    return sd


BAD_LOAD_STEPS = {
    "None": None,
    "str": "5",
    "list": [5],
    "meta": torch.tensor(1.0, device="meta"),
    "negative": torch.tensor(-3.0),
    "fraction": 2.5,
    "nan": torch.tensor(math.nan),
    "inf": math.inf,
    "two values": torch.tensor([1.0, 2.0]),
    "bool": True,
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", list(BAD_LOAD_STEPS))
def test_load_rejects_unusable_step_counters(kind, mode):
    params, twin_params = make_params(), make_params()
    ours, twin = make_ours(params, mode), make_ours(twin_params, mode)
    step_all((ours, twin), 1)
    before = snapshot(ours)
    with pytest.raises(ValueError, match="step"):
        ours.load_state_dict(_sd_with_step(BAD_LOAD_STEPS[kind]))
    assert_same_snapshot(before, snapshot(ours), f"after the rejected load ({kind})")
    for step in (2, 3):
        step_all((ours, twin), step)
    assert_bitwise_twins(ours, twin, "steps after the rejected load")


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize(
    "value", [2**63 + 2**40, np.float32(12.0), np.int64(12), 2.0**100], ids=str
)
def test_load_accepts_large_and_numpy_step_counters(value, mode):
    """Counters beyond 2^63 (bias corrections exactly 1) and NumPy scalars load and train
    like torch with the same checkpoint."""
    sd = _sd_with_step(value)
    ours, theirs = make_ours(make_params(), mode), make_torch(make_params())
    ours.load_state_dict(copy.deepcopy(sd))
    theirs.load_state_dict(copy.deepcopy(sd))
    for step in (2, 3, 4):
        step_all((ours, theirs), step)
        assert_matches_torch(ours, theirs, VS_TORCH, f"step {step}")


@pytest.mark.parametrize("mode", ["fused", "mixed"])
@pytest.mark.parametrize("value", [math.nan, -5.0, 1e30, 0.0], ids=str)
def test_device_side_counter_writes_never_give_nan(value, mode):
    """Note [Step counter range]: a counter written in place (where only the device sees
    it) is clamped by the kernels' arithmetic instead of overflowing into NaN."""
    ours = make_ours(make_params(), mode)
    step_all((ours,), 1)
    for g in ours.param_groups:
        for p in g["params"]:
            if p in ours.state and ours.state[p]:
                ours.state[p]["step"].fill_(value)
    for step in (2, 3):
        step_all((ours,), step)
    for g in ours.param_groups:
        for p in g["params"]:
            assert torch.isfinite(p).all()
            for k, v in ours.state[p].items():
                if k != "step":  # a NaN counter stays NaN; what it drives stays finite
                    assert torch.isfinite(v).all(), k


def test_loading_an_adam_state_dict_keeps_the_update_decoupled():
    """torch.optim.Adam's groups carry decoupled_weight_decay=False; the update here is
    always decoupled, and the group says so, as torch.optim.AdamW does."""
    params = make_params()
    adam = torch.optim.Adam([{"params": ps} for ps in params], lr=1e-3, weight_decay=0.1)
    step_all((adam,), 1)
    sd = copy.deepcopy(adam.state_dict())
    assert sd["param_groups"][0]["decoupled_weight_decay"] is False
    for mode in MODES:
        ours = make_ours(make_params(), mode)
        ours.load_state_dict(copy.deepcopy(sd))
        assert all(g["decoupled_weight_decay"] is True for g in ours.param_groups)
        theirs = make_torch(make_params())
        theirs.load_state_dict(copy.deepcopy(sd))
        assert all(g["decoupled_weight_decay"] is True for g in theirs.param_groups)
        for step in (2, 3):
            step_all((ours, theirs), step)
        assert_matches_torch(ours, theirs, VS_TORCH, mode)


# --------------------------------------------------------------------------- pickling


@pytest.mark.parametrize("mode", ["fused"])
@pytest.mark.parametrize("via", ["deepcopy", "pickle", "torch.save"])
def test_optimizer_wide_options_survive_copies(via, mode):
    import io
    import pickle

    ours = make_ours(make_params(), mode, hierarchical_stats=True, max_grad_norm=0.25)
    step_all((ours,), 1)
    if via == "deepcopy":
        clone = copy.deepcopy(ours)
    elif via == "pickle":
        clone = pickle.loads(pickle.dumps(ours))
    else:
        buf = io.BytesIO()
        torch.save(ours, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    assert clone.hierarchical_stats is True and clone.max_grad_norm == 0.25
    ref = copy.deepcopy(clone)
    step_all((clone, ref), 2)
    assert clone.last_report is not None
    # The copy still clips: its step equals a fresh optimizer's with the same options.
    assert_bitwise_twins(clone, ref)
    norm = clone.last_report.grad_norm.item()
    assert norm > 0.25, "the gradients of this test are above the clipping threshold"


def test_older_pickles_without_the_options_still_load():
    ours = make_ours(make_params(), "fused")
    state = ours.__getstate__()
    for key in ("hierarchical_stats", "max_grad_norm", "process_group"):
        del state[key]
    old = ruda_torch.AdamW.__new__(ruda_torch.AdamW)
    old.__setstate__(state)
    assert old.hierarchical_stats is False and old.max_grad_norm is None
    step_all((old,), 1)


# --------------------------------------------------------------------------- named params


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_named_parameters_like_torch(fused, tmp_path):
    torch.manual_seed(0)
    mo = _Model()
    mt = copy.deepcopy(mo)
    ours = ruda_torch.AdamW(mo.named_parameters(), **HYPER, fused_step=fused)
    theirs = torch.optim.AdamW(mt.named_parameters(), **HYPER, foreach=False)
    assert ours.param_groups[0]["param_names"] == theirs.param_groups[0]["param_names"]
    for step in range(3):
        x = rand((4, 7), step)
        ours.zero_grad()
        mo(x).square().mean().backward()
        copy_grads(mo, mt)  # Note [Twins share gradients] in tests/optim_harness.py
        ours.step()
        theirs.step()
    assert_matches_torch(ours, theirs, VS_TORCH)
    sd = ours.state_dict()
    assert sd["param_groups"][0]["param_names"] == [n for n, _ in mo.named_parameters()]
    path = tmp_path / "opt.pt"
    torch.save(sd, path)
    loaded = torch.load(path, weights_only=True)
    resumed_model = copy.deepcopy(mo)
    resumed = ruda_torch.AdamW(resumed_model.named_parameters(), lr=0.5, fused_step=fused)
    resumed.load_state_dict(loaded)
    assert resumed.param_groups[0]["param_names"] == sd["param_groups"][0]["param_names"]
    torch_resumed = torch.optim.AdamW(copy.deepcopy(mo).named_parameters())
    torch_resumed.load_state_dict(torch.load(path, weights_only=True))  # ours loads into torch
    ours.zero_grad()
    mo(rand((4, 7), 9)).square().mean().backward()
    copy_grads(mo, resumed_model)
    ours.step()
    resumed.step()
    assert_bitwise_twins(ours, resumed, "resumed through torch.save/torch.load(weights_only)")


@pytest.mark.parametrize("fused", [False, True], ids=["generic", "fused"])
def test_duplicate_parameter_warns_as_torch_and_the_fused_step_refuses(fused):
    """torch warns at construction (its add_param_group; torch's test_errors expects the
    warning); the fused step, which would update the parameter twice, refuses, writing
    nothing."""
    p = nn.Parameter(torch.randn(4))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = ruda_torch.AdamW([p, p], fused_step=fused)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        torch.optim.AdamW([p, p])
    p.grad = torch.randn(4)
    before = p.detach().clone()
    if fused:
        with pytest.raises(ValueError, match="lists the same parameter twice"):
            opt.step()
        assert torch.equal(p, before) and not opt.state
    else:
        opt.step()  # torch's for-loop path too steps it twice


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "value, message",
    [
        ("1.0", r"Invalid max_grad_norm: '1\.0' of type str"),
        (True, "of type bool"),
        (-1.0, "positive and finite"),
        (math.nan, "positive and finite"),
    ],
    ids=["str", "bool", "negative", "nan"],
)
def test_max_grad_norm_messages_name_the_value_and_type(value, message):
    with pytest.raises(ValueError, match=message):
        ruda_torch.AdamW(make_params()[0], max_grad_norm=value)


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), 1], ids=str)
def test_max_grad_norm_takes_any_real_number(value):
    opt = ruda_torch.AdamW(make_params()[0], max_grad_norm=value)
    assert opt.max_grad_norm == float(value) and type(opt.max_grad_norm) is float


def test_process_group_must_be_a_process_group():
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        ruda_torch.AdamW(make_params()[0], process_group=object())


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64], ids=str)
def test_generic_path_clips_fp64_and_complex_parameters_like_torch(dtype):
    gen = torch.Generator().manual_seed(3)
    base = [
        torch.randn(33, dtype=dtype, generator=gen),
        torch.randn(4, 4, dtype=dtype, generator=gen),
    ]
    po = [nn.Parameter(t.clone()) for t in base]
    pt = [nn.Parameter(t.clone()) for t in base]
    ours = ruda_torch.AdamW(po, **HYPER, max_grad_norm=0.1)
    theirs = torch.optim.AdamW(pt, **HYPER, foreach=False)
    for _ in range(3):
        for a, b in zip(po, pt, strict=True):
            g = torch.randn(a.shape, dtype=dtype, generator=gen)
            a.grad, b.grad = g.clone(), g.clone()
        torch.nn.utils.clip_grad_norm_(pt, 0.1)
        ours.step()
        theirs.step()
    for a, b in zip(po, pt, strict=True):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", list(MODES))
def test_python_number_steps_in_the_state_are_taken(mode):
    """torch's own step raises on a Python-number step in optimizer.state; ours takes it
    as that count (an older checkpoint's format), exactly as a tensor of it."""
    ours, ref = make_ours(make_params(), mode), make_ours(make_params(), mode)
    for step in (1, 2):
        step_all((ours, ref), step)
    for gi, j in ((0, 0), (1, 0)):
        ours.state[_p(ours, gi, j)]["step"] = 6
        ref.state[_p(ref, gi, j)]["step"] = torch.tensor(6.0)
    for step in (3, 4):
        step_all((ours, ref), step)
        assert_bitwise_twins(ours, ref, f"step {step}")
    assert ours.state[_p(ours, 0, 0)]["step"].item() == 8
