"""The fused plan: the buckets of every fused param group, derived from
``optimizer.state`` and ``param_groups`` and derived again when they change.

Note [Fused state coherence]
``optimizer.state`` and ``param_groups`` are the truth, as in every torch optimizer; the
buckets are a cache derived from them (a ``FusedPlan``). The plan records what it was
derived from: the identities of the param_groups list, of each group dict and of each
fused group's parameter list and parameters, the ``fused_step``/``amsgrad``/
``master_weights`` flags, the identity of the state mapping and of every (key, value) in
it, of every item of the state entry of a fused parameter, the dtype, device, shape and
strides of every fused parameter, and what every state view in the entries is (its
storage, offset, dtype, sizes and strides, Note [Exact views] in csrc/py_records.h:
``view.data = t`` or ``view.t_()`` keeps the view object but changes what it shows).
Before every step,
``FusedPlan.is_current`` compares all of it: a few Python checks per param group and
loops over pointers in C on all of torch's threads (``_C.unchanged``, Note [Checks on all
threads] in csrc/py_checks.cpp), a few milliseconds for 20,000 parameters and their 60,000
state views, bound by the memory latency of reading each object once. Any difference,
whatever made it (``load_state_dict`` of ours, torch's or ZeroRedundancyOptimizer's,
``state.clear()``, ``opt.state = defaultdict(dict)``, ``opt.state[p] = {...}``,
``del opt.state[p]``, a replaced state tensor, a parameter replaced, added or removed in a
group, ``p.data = ...`` with another shape, a toggled ``amsgrad`` or ``fused_step``), makes the step derive the plan again (``derive``):

1. Decide and validate everything, writing nothing: which buckets are kept (the same
   parameters in the same order with the same shapes, devices and scopes, and an AMSGrad
   buffer where the group needs one) and which are built anew, and for each fused
   parameter what its state entry is:
   - absent or empty: no state; the parameter gets fresh zero state at its next step
     with a gradient, as in torch (its slot is zeroed then);
   - exactly the views of its own slot: nothing to do;
   - anything else (loaded tensors, a user's, views of another slot or of an old
     bucket): checked to be torch.optim.AdamW's state for this parameter (keys, shapes,
     floating dtypes, a valid step counter), to be copied into the slot.
   A parameter with state whose shape changed is an error, as in torch; so are a state
   entry that is not AdamW's, a duplicate parameter and a parameter the kernel cannot take.
2. Commit: copy the adopted values into their slots (sources that share memory with a
   kept bucket are cloned first, so that swapping two entries works), put the slot's
   views into each adopted entry (in place: the entry dict stays the user's object), and
   record the new plan.
A rejected derivation writes nothing and raises, and so does the step that asked for it.
Only identities are compared, never values: an in-place write into a state view
(``state[p]["exp_avg"].zero_()``, ``state[p]["step"].fill_(0)``) is a write into the
bucket itself and needs nothing. The views are checked as facts (Note [Exact views]), not
through a proxy such as the buffer's sharing count, which another tensor kept on the
buffer defeats; the cost is one TensorImpl read per view, in the same prefetched C loop.
DTensor state views (FSDP2) are checked by identity. A tensor taken out of
``optimizer.state`` may still share memory with the slot it came from (adoption copies in
place rather than doubling the memory of the bucket).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import MutableMapping
from operator import is_ as _same

import torch

from . import _C
from ._checkpoint import in_layout_of
from ._common import CODED_KEYS, MASTER_KEYS, MIN_8BIT_SIZE, STATE_KEYS, local, master_kind
from ._fused import Bucket
from ._options import check_fused_param, check_group_options
from ._state8bit import bucket_precision, check_mesh_8bit, moment_format
from ._validate import check_no_duplicates, check_state_entry, check_stats_dtype
from .distributed import scope_of


class FusedPlan:
    """The buckets of every fused param group, and what they were derived from (Note
    [Fused state coherence])."""

    def __init__(self, groups: list[tuple[int, dict, list[Bucket]]]):
        self.groups = groups  # (group index, group dict, its buckets)
        self.buckets = [b for _, _, bs in groups for b in bs]
        self.spare: list[Bucket] = []  # buckets of groups out of param_groups (derive)

    def record(self, opt) -> None:
        """Remember what is_current() compares; called after every change that the
        optimizer itself makes to the state (derive, fresh state in a step)."""
        self._param_groups = opt.param_groups
        self._group_dicts = list(opt.param_groups)
        self._flags = [_flags(g) for g in opt.param_groups]
        self._state = opt.state
        containers = [opt.state]
        expected = [x for item in opt.state.items() for x in item]
        counts = [len(expected)]  # items of `expected` per container
        tensors, views = [], []
        for _, group, buckets in self.groups:
            containers.append(group["params"])
            expected.extend(group["params"])
            counts.append(len(group["params"]))
            for b in buckets:
                tensors.extend(b.params)
                for entry, mine in zip(b.entries, b.views, strict=True):
                    if entry is not None:
                        containers.append(entry)
                        expected.extend(x for item in entry.items() for x in item)
                        counts.append(2 * len(entry))
                        views.extend(v for v in mine.values() if type(v) is torch.Tensor)
        self._params_lists = [g["params"] for _, g, _ in self.groups]
        shapes = torch.tensor(_C.layout_record(tensors), dtype=torch.int64)
        facts = torch.tensor(_C.view_record(views), dtype=torch.int64)
        counts = torch.tensor(counts, dtype=torch.int64)
        self._check = (containers, counts, expected, tensors, shapes, views, facts)

    def is_current(self, opt) -> bool:
        groups = opt.param_groups
        if (
            opt.state is not self._state
            or len(groups) != len(self._group_dicts)
            or not all(map(_same, groups, self._group_dicts))
            or [_flags(g) for g in groups] != self._flags
            or not all(
                g["params"] is lst
                for (_, g, _), lst in zip(self.groups, self._params_lists, strict=True)
            )
        ):
            return False
        return _C.unchanged(*self._check)


def _flags(group: dict) -> tuple:
    return (
        bool(group.get("fused_step")),
        bool(group.get("amsgrad")),
        master_kind(group),
        bool(group.get("flat_grads")),
        group.get("state_precision", "fp32"),
        group.get("min_8bit_size", MIN_8BIT_SIZE),
    )


def split_group(opt, gi: int, group: dict, needs_global: bool) -> list:
    """The buckets' parameters of a fused group: (scope, moment precision, parameters,
    their positions) per device, dtype, scope and precision (Note [8-bit buckets] in
    ruda_torch/_state8bit.py; Note [Scopes]: one group may mix placements), in order of
    first appearance, after checking every parameter; writes nothing."""
    params = group["params"]
    check_group_options(group, gi)
    for j, p in enumerate(params):
        check_fused_param(p, gi, j, group)
        if opt.hierarchical_stats:
            check_stats_dtype(p.dtype, gi, j)
    check_no_duplicates(params, gi)
    by_key: dict = {}
    for j, p in enumerate(params):
        scope = scope_of(p, opt.process_group, needs_global, f"param group {gi} parameter {j}",
                         opt.partition_group)  # fmt: skip
        precision = bucket_precision(p, group)
        if precision in ("8bit", "4bit"):
            check_mesh_8bit(p, f"param group {gi} parameter {j}", int(precision[0]))
        key = (local(p).device, p.dtype, scope, precision)
        by_key.setdefault(key, (scope, precision, [], []))
        by_key[key][2].append(p)
        by_key[key][3].append(j)
    return list(by_key.values())


def derive(opt, previous: FusedPlan | None, needs_global: bool) -> FusedPlan:
    """A plan for the current ``param_groups`` and ``state`` (Note [Fused state
    coherence]); validates everything before the first write."""
    state = opt.state
    kept: dict[tuple, Bucket] = {}
    if previous is not None:
        # The buckets of the previous plan, and those of groups that a swapped param_groups
        # left out (Note [Swapped param_groups] in optimizer.py): kept while a state entry
        # still holds their views, so they cost no memory the state does not hold anyway.
        for b in (*previous.spare, *previous.buckets):
            kept[tuple(map(id, b.params))] = b
    groups = []
    adopt = []  # (bucket, slot, parameter, entry, step counter, whether to view the maximum)
    forget = []  # (bucket, slot)
    reused: list[Bucket] = []
    owner: dict[int, int] = {}  # parameter id -> the fused group that lists it
    for gi, group in enumerate(opt.param_groups):
        if not group.get("fused_step"):
            continue
        for p in group["params"]:
            first = owner.setdefault(id(p), gi)
            if first != gi:
                raise ValueError(
                    f"a parameter appears in param groups {first} and {gi}; every parameter "
                    "belongs to one group (torch's add_param_group enforces this too)"
                )
        amsgrad = bool(group["amsgrad"])
        master = master_kind(group)
        flat = bool(group.get("flat_grads"))
        buckets = []
        for scope, precision, ps, js in split_group(opt, gi, group, needs_global):
            b = kept.pop(tuple(map(id, ps)), None)
            if b is not None and b.can_serve(ps, scope, amsgrad, master, flat, precision):
                reused.append(b)
            else:
                b = Bucket(ps, amsgrad, scope, master, flat, precision)
            buckets.append(b)
            for i, (p, j) in enumerate(zip(ps, js, strict=True)):
                where = f"optimizer.state of param group {gi} parameter {j}"
                entry = state.get(p)
                if not entry:
                    if b.views[i] is not None:
                        forget.append((b, i))
                    continue
                if b.owns(i, entry):
                    continue
                step = check_state_entry(entry, p, where)
                if not isinstance(entry, MutableMapping):
                    entry = dict(entry)
                with_max = amsgrad or moment_format(entry, "max_exp_avg_sq", where) is not None
                adopt.append((b, i, p, entry, step, with_max))
        groups.append((gi, group, buckets))

    # Commit: nothing above wrote anything.
    if not isinstance(state, defaultdict):  # a user's plain mapping: torch's code needs [] too
        state = opt.state = defaultdict(dict, state)
    kept_memory = {buf.untyped_storage().data_ptr() for b in reused for buf in b.buffers}
    staged = []
    for b, i, p, entry, step, with_max in adopt:
        # Local tensors in p's layout (Note [Entries in another layout]).
        values = in_layout_of(p, entry, (*STATE_KEYS, *CODED_KEYS, *MASTER_KEYS))
        for key, value in values.items():
            if value.untyped_storage().data_ptr() in kept_memory:
                values[key] = value.clone()
        staged.append((b, i, p, entry, step, values, with_max))
    for b, i in forget:
        b.forget(i)
    for b, i, _, _, step, values, _ in staged:
        b.write_slot(i, step, values)
    # All new tensors first, one after another, then into the entries (whose old values
    # are freed there): Note [Tensors of their own] in csrc/py_records.h.
    made = [b.own_views(i, with_max) for b, i, _, _, _, _, with_max in staged]
    for (b, i, p, entry, _, _, _), views in zip(staged, made, strict=True):
        b.install(i, entry, views)
        if state.get(p) is not entry:
            state[p] = entry
    plan = FusedPlan(groups)
    plan.spare = [b for b in kept.values() if b.holds_state(state)]
    plan.record(opt)
    return plan


def current_plan(opt) -> FusedPlan:
    """``opt``'s buckets, derived again when the state or the groups changed (Note [Fused
    state coherence]); raises, writing nothing, when they cannot be."""
    plan = opt._plan
    if plan is not None and plan.is_current(opt):
        return plan
    # Note [Swapped param_groups] in ruda_torch/optimizer.py: a plan per recent list of
    # groups, so that DeepSpeed's one-group-at-a-time steps check a plan instead of deriving
    # one at every swap.
    # Only plans of the optimizer's own groups are kept (a plan holds its buckets'
    # memory: one of groups that a load replaced must go).
    home = {id(g) for g in opt._home_groups}
    others = {k: v for k, v in opt.__dict__.get("_other_plans", {}).items() if home.issuperset(k)}
    opt._other_plans = others
    if plan is not None and home.issuperset(map(id, plan._group_dicts)):
        others[tuple(map(id, plan._group_dicts))] = plan
    key = tuple(map(id, opt.param_groups))
    cached = others.pop(key, None)
    if cached is not None and cached.is_current(opt):
        opt._plan = cached
        return cached
    needs_global = opt.hierarchical_stats or opt.max_grad_norm is not None
    plan = opt._plan = derive(opt, plan, needs_global)
    while len(others) > 4:  # the oldest go
        others.pop(next(iter(others)))
    return plan
