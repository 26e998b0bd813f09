"""The step's three phases as functions over lists, with ``AdamW._step`` (the compile
boundary) calling them in turn (Note [Atomic step] in ruda_torch/optimizer.py):

- ``gather``: the plan (its buckets derived again where the state or groups changed),
  every kernel call of every bucket with its active parameters and gradients, the generic
  parameters, the norm's scopes, and every check, including the kernels' own argument
  checks where a later call could fail after an earlier one wrote: nothing is written;
- ``create_state``: the state of parameters that have a gradient for the first time;
- ``apply``: the statistics (or the tensor-operation norm), then one kernel call per
  bucket and gradient dtype and the generic updates, then the flat views put back.
"""

from __future__ import annotations

import functools
import operator
import warnings
from dataclasses import dataclass, field

import torch

from . import _C, _fused, _generic, _options, _stats, ops
from ._common import is_dense, local
from ._validate import check_stats_dtype
from .distributed import scope_of
from .report import GradientReport


@dataclass
class FusedCall:
    """One kernel call: the active parameters of one bucket with one gradient dtype."""

    bucket: _fused.Bucket
    group: dict
    active: list[int]
    grads: list[torch.Tensor]
    gi: int  # index of the param group, for messages
    flat: bool = False  # through the bucket's flat-gradient handle


@dataclass
class StepWork:
    """What ``gather`` found, for the later phases."""

    plan: object
    calls: list = field(default_factory=list)  # FusedCall
    fresh: list = field(default_factory=list)  # (bucket, slot, amsgrad) that get state now
    readopt: list = field(default_factory=list)  # (bucket, slots): flat views to put back
    generic: list = field(default_factory=list)  # (group, params, grads), fused_step=False
    numeric_steps: list = field(default_factory=list)  # generic steps held as numbers
    # The tensor-op norm's scopes on the generic path: (scope, gradient) for each gradient,
    # and the scope of every generic parameter, in order (_stats).
    norm_grads: list = field(default_factory=list)
    norm_scopes: list = field(default_factory=list)
    per_device: _stats.PerDevice = field(default_factory=_stats.PerDevice)


def gather(opt, grad_scale, found_inf) -> StepWork:
    """Phase 1: gather and validate everything; nothing is written."""
    if opt.hierarchical_stats or opt.max_grad_norm is not None:
        check_whole_groups(opt)
    for gi, group in enumerate(opt.param_groups):  # they may have changed since
        _options.check_group(group, gi, "step", opt.hierarchical_stats)
    work = StepWork(opt._current_plan())
    for gi, group, buckets in work.plan.groups:
        _options.check_bucket_options(group, gi, buckets)
    for gi, group, buckets in work.plan.groups:
        for b in buckets:
            _gather_bucket(b, group, gi, work)
    new_state = bool(work.fresh)
    new_state |= _gather_generic(opt, work)
    calls = work.calls
    if any(c.bucket.device.type == "cuda" for c in calls) and (
        torch.cuda.is_current_stream_capturing()
    ):
        check_capturable(opt, calls, work.generic)
    if opt.hierarchical_stats:
        for c in calls:  # raises for a gradient too large for one report
            check_stats_dtype(c.bucket.dtype, c.gi)
            c.bucket.row_pieces(c.active)
    # The kernels check their arguments before they write: one call needs nothing more,
    # unless state is created first (phase 2 writes before the first kernel call).
    if len(calls) > 1 or (calls and (new_state or work.numeric_steps)):
        for c in calls:
            run_kernel(opt, ops.check_adamw_scaled, c, grad_scale, found_inf, None, None,
                       work.per_device)  # fmt: skip
    return work


def _gather_bucket(b, group: dict, gi: int, work: StepWork) -> None:
    """The kernel calls of one bucket: its parameters with a gradient, by gradient dtype."""
    if b.flat:
        replaced, unwritten = b.check_grads()
        b.check_replaced(replaced, gi)  # their views go back after the step
        if replaced:  # this step takes the gradients where they are
            work.readopt.append((b, replaced))
        else:
            flat_call(b, group, gi, unwritten, work.calls, work.fresh)
            return
    grads, missing, mixed, relayout = _C.grads_of(b.params)
    if not missing:
        active = b.all_slots
    else:
        if missing == len(grads):
            return
        active = [i for i, g in enumerate(grads) if g is not None]
        grads = [grads[i] for i in active]
    if b.n_with_state != len(b.params):
        work.fresh.extend((b, i, group["amsgrad"]) for i in active if b.views[i] is None)
    if b.distributed:
        grads = [local(g) for g in grads]
    if relayout or (b.eight_bit and b.staged):  # 8-bit moments stage permuted layouts too
        grads = [in_layout(b.targets[i], g) for i, g in zip(active, grads, strict=True)]
    call = FusedCall(b, group, active, grads, gi)
    work.calls.extend(split_by_dtype(call) if mixed else (call,))


def _gather_generic(opt, work: StepWork) -> bool:
    """The generic groups' parameters with a gradient, checked; whether any needs state."""
    new_state = False
    for gi, group in enumerate(opt.param_groups):
        if group.get("fused_step"):
            continue
        indexed = [(j, p) for j, p in enumerate(group["params"]) if p.grad is not None]
        params = [p for _, p in indexed]
        grads = [p.grad for p in params]
        _generic.check_generic(gi, indexed, grads)
        if opt.max_grad_norm is not None:  # the norm's scopes, checked up front
            for j, p in enumerate(group["params"]):
                scope = scope_of(p, opt.process_group, True,
                                 f"param group {gi} parameter {j}", opt.partition_group)  # fmt: skip
                if scope not in work.norm_scopes:
                    work.norm_scopes.append(scope)
                if p.grad is not None:
                    work.norm_grads.append((scope, p.grad))
        for j, p in indexed:
            st = opt.state.get(p)
            if not st:
                new_state = True
            elif _generic.check_entry(st, p, group["amsgrad"], f"optimizer.state of "
                                      f"param group {gi} parameter {j}"):  # fmt: skip
                work.numeric_steps.append(p)
        if params:
            work.generic.append((group, params, grads))
    return new_state


def create_state(opt, work: StepWork) -> None:
    """Phase 2: state for parameters that are active for the first time."""
    for b, i, _ in work.fresh:
        b.clear_fresh(i)
    made = [b.own_views(i, amsgrad) for b, i, amsgrad in work.fresh]  # Bucket.own_views
    for (b, i, _), views in zip(work.fresh, made, strict=True):
        b.install(i, opt.state[b.params[i]], views)
    for p in work.numeric_steps:
        st = opt.state[p]
        st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32, device=local(p).device)
    created = bool(work.numeric_steps)
    for group, params, _ in work.generic:
        for p in params:
            if len(opt.state[p]) == 0:
                opt.state[p] = _generic.fresh_state(p, group["amsgrad"])
                created = True
            elif group["amsgrad"] and "max_exp_avg_sq" not in opt.state[p]:
                opt.state[p]["max_exp_avg_sq"] = torch.zeros_like(p)
                created = True
    if work.fresh or created:
        work.plan.record(opt)


def apply(opt, work: StepWork, grad_scale, found_inf) -> None:
    """Phase 3: statistics or norm, then the updates, then the flat views put back."""
    per_device = work.per_device
    stats = clip_coef = None
    if opt.hierarchical_stats:
        stats = _stats.gradient_report(
            work.calls, work.plan.buckets, grad_scale, per_device, opt.partition_group
        )
    elif opt.max_grad_norm is not None:
        clip_coef = _stats.tensor_norm_clip(
            opt.max_grad_norm, work.calls, (work.norm_grads, work.norm_scopes),
            work.plan.buckets, grad_scale, opt.partition_group,
        )  # fmt: skip
    # The kernels read an FP32 coefficient, and FP64 buckets clip_grad_norm_'s FP64 one
    # (tensor_norm_clip makes it FP64 where a gradient is FP64): rounded to FP32 it would
    # clip FP64 gradients by another number than torch.
    clip32 = clip_coef
    if clip_coef is not None and clip_coef.dtype != torch.float32:
        clip32 = clip_coef.to(torch.float32)
    for c in work.calls:
        clip = clip_coef if c.bucket.dtype == torch.float64 else clip32
        run_kernel(opt, ops.adamw_scaled_, c, grad_scale, found_inf, stats, clip, per_device)
    for group, params, grads in work.generic:
        for p, grad in zip(params, grads, strict=True):
            dev = p.device
            _generic.update(
                p, grad, opt.state[p], group,
                per_device.get(grad_scale, dev), per_device.get(found_inf, dev),
                per_device.get(clip_coef, dev),
            )  # fmt: skip
    if stats is not None:
        opt.last_report = GradientReport(stats, opt.max_grad_norm, found_inf)
    readopt(opt, work.plan, work.readopt)


def flat_call(b, group, gi: int, unwritten: list[int], calls, fresh) -> None:
    """The kernel call of a flat bucket whose views are all in place: every parameter
    whose view was written since zero_grad() (Note [Flat gradient buckets])."""
    if not unwritten:
        active, grads = b.all_slots, b.grad_views
    else:
        skip = set(unwritten)
        active = [i for i in b.all_slots if i not in skip]
        if not active:
            return
        grads = [b.grad_views[i] for i in active]
    if b.n_with_state != len(b.params):
        fresh.extend((b, i, group["amsgrad"]) for i in active if b.views[i] is None)
    calls.append(FusedCall(b, group, active, grads, gi, flat=True))


def readopt(opt, plan, readopt) -> None:
    """After a step that found flat views replaced (``model.zero_grad()``, an assigned
    ``p.grad``, DDP with ``gradient_as_bucket_view=True``, backward with
    ``create_graph=True``): the gradients go back into the views, values kept. When
    that happened at two steps in a row, something replaces them every iteration and
    copying them back would only add a pass: the bucket is left with the gradients
    where they are (stepped as with flat_grads=False) until this optimizer's
    zero_grad() puts the views back."""
    replaced_now = {id(b) for b, _ in readopt}
    for b in plan.buckets:
        if b.flat:
            b.replaced_in_a_row = b.replaced_in_a_row + 1 if id(b) in replaced_now else 0
    for b, replaced in readopt:
        if b.replaced_in_a_row < 2:
            b.adopt_grads(replaced)
            continue
        if not opt._flat_warned:
            opt._flat_warned = True
            warnings.warn(
                f"ruda_torch.AdamW(flat_grads=True): {len(replaced)} gradient(s) of a "
                f"bucket on {b.device} were not the flat buffer's views at two steps in a "
                "row: something replaces the gradients every iteration (model.zero_grad() "
                "or another optimizer's zero_grad(set_to_none=True), DDP with "
                "gradient_as_bucket_view=True, backward(create_graph=True)). These "
                "gradients are stepped where they are, as with flat_grads=False, until "
                "this optimizer's zero_grad() puts the views back; call it instead of "
                "model.zero_grad(), or pass flat_grads=False (docs/usage.md).",
                stacklevel=5,
            )


# Note [Capturing a step in a CUDA graph]
# A replayed graph repeats the kernel launches with the arguments they were captured
# with, and reads every device tensor anew: so what changes between steps must live
# in device memory. The step counters, GradScaler's scale and found_inf and a Tensor
# lr do (the kernels read them); a float lr is baked in at capture. The tensor table
# of a flat-gradient bucket stays at one device address, rewritten only when the set
# of parameters with a gradient changes (refused during capture), while the gathered
# path uploads a fresh table per call from reused pinned memory, which a replay would
# read stale: so a captured step needs flat_grads=True in every fused group. The
# statistics of a flat bucket keep their tables on the device the same way, so
# hierarchical_stats (with max_grad_norm: skip and clip decided on the device) is
# capturable; the tensor-op norm of max_grad_norm alone is not supported under capture.
# Capture after a few eager steps (the first one creates the state and places the
# tables), as torch's own capturable optimizers require.
def check_capturable(opt, calls, generic) -> None:
    def refuse(what: str) -> None:
        raise RuntimeError(
            f"ruda_torch.AdamW.step() is being captured in a CUDA graph, but {what}. A "
            "capturable step needs fused_step=True and flat_grads=True in every group "
            "with CUDA parameters (clipping through hierarchical_stats=True), after at "
            "least one eager step (Note [Capturing a step in a CUDA graph])"
        )

    for c in calls:
        if not c.flat:
            refuse(f"param group {c.gi} steps gathered gradients (flat_grads=False, or "
                   "its gradients were replaced since the last step)")  # fmt: skip
        if c.bucket.n_with_state != len(c.bucket.params):
            refuse(f"param group {c.gi} has parameters without state yet")
    if generic:
        refuse("a group has fused_step=False")
    if opt.max_grad_norm is not None and not opt.hierarchical_stats:
        refuse("max_grad_norm is set without hierarchical_stats=True (the tensor-op norm)")


# Note [Swapped param_groups] in ruda_torch/optimizer.py: a norm or a report of some of
# the groups is not the model's.
def check_whole_groups(opt) -> None:
    groups, home = opt.param_groups, opt._home_groups
    if groups is home or len(groups) >= len(home):
        return
    home_ids = {id(g) for g in home}
    if all(id(g) in home_ids for g in groups):
        what = []
        if opt.max_grad_norm is not None:
            what.append(f"max_grad_norm={opt.max_grad_norm}")
        if opt.hierarchical_stats:
            what.append("hierarchical_stats=True")
        raise ValueError(
            f"optimizer.param_groups holds {len(groups)} of this optimizer's "
            f"{len(home)} param groups for this step (DeepSpeed's ZeRO steps one group at "
            f"a time this way), so {' and '.join(what)} would decide clipping and skipping "
            "from one group's gradients only. Under DeepSpeed, clip with its "
            '"gradient_clipping" config and leave max_grad_norm and hierarchical_stats '
            "unset (or use one param group); to remove groups for good, delete them from "
            "optimizer.param_groups in place"
        )


def run_kernel(opt, op, c: FusedCall, grad_scale, found_inf, stats, clip_coef, per_device):
    """One kernel call (``adamw_scaled_``) or its validation (``check_adamw_scaled``)."""
    b, g, dev = c.bucket, c.group, c.bucket.device
    lr = g["lr"]
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":  # read by the kernel
        lr = per_device.get(lr, dev)  # (a CPU Tensor lr is read by the binding)
    writes = op is ops.adamw_scaled_
    if writes:
        b.reset_written(c.active)
    if writes and b.staged:
        b.stage_in(c.active)
    all_active = len(c.active) == len(b.params)
    if c.flat:
        op = functools.partial(
            ops.flat_step, b.handle(), None if all_active else c.active,
            validate_only=not writes, amsgrad=g["amsgrad"], state_dtype=b.exp_avg.dtype,
        )  # fmt: skip
    else:
        op = functools.partial(
            op,
            b.targets if all_active else [b.targets[i] for i in c.active],
            c.grads,
            b.exp_avg,
            b.exp_avg_sq,
            b.max_exp_avg_sq if g["amsgrad"] else None,
            b.steps,
            b.slots(c.active),
            master=b.master,
            scales=b.scales_for(bool(g["amsgrad"])),
        )
    try:
        op(
            lr=lr,
            beta1=g["betas"][0],
            beta2=g["betas"][1],
            eps=g["eps"],
            weight_decay=g["weight_decay"],
            maximize=g["maximize"],
            grad_scale=per_device.get(grad_scale, dev),
            found_inf=per_device.get(found_inf, dev),
            stats=per_device.get(stats, dev),
            max_grad_norm=opt.max_grad_norm if stats is not None and opt.max_grad_norm else 0.0,
            clip_coef=per_device.get(clip_coef, dev),
            stochastic_rounding=bool(g["stochastic_rounding"]) and b.dtype == torch.bfloat16,
            seed=g["rounding_seed"],
            state_rounding=g["state_rounding"],
            decoupled=bool(g.get("decoupled_weight_decay", True)),
        )
    except RuntimeError as e:
        # The operator counts the call's tensors: name the group, and the parameter
        # when the message names one.
        where = f"param group {c.gi}"
        if len(c.active) != len(b.params) or len(b.params) != len(g["params"]):
            where += " (tensor indices below count its parameters with a gradient on "
            where += f"{dev}: group positions {positions(g, b, c.active)})"
        raise RuntimeError(f"{where}: {e}") from e
    if writes and b.staged:
        b.stage_out(c.active)
    if writes:
        b.note_versions(c.active)


def in_layout(target: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g``, or a copy of it laid out in memory as the kernel steps ``target`` (Note
    [Dense layouts] in csrc/bindings.cpp): the gradient of a dense parameter with other
    strides, or a non-contiguous one for a staged parameter. Autograd's gradients need
    none. A gradient of another shape or a sparse one is left for the binding's error."""
    if g.shape != target.shape or g.layout != torch.strided:
        return g
    if not target.is_contiguous() and is_dense(target):
        if is_dense(g) and all(
            n <= 1 or a == b
            for n, a, b in zip(target.shape, target.stride(), g.stride(), strict=True)
        ):
            return g
        return torch.empty_like(target, dtype=g.dtype).copy_(g)
    return g if g.is_contiguous() else g.contiguous()


def positions(group: dict, b: _fused.Bucket, active: list[int]) -> str:
    index = {id(p): j for j, p in enumerate(group["params"])}
    pos = [index[id(b.params[i])] for i in active]
    return str(pos) if len(pos) <= 8 else f"[{', '.join(map(str, pos[:8]))}, ...]"


def split_by_dtype(call: FusedCall) -> list[FusedCall]:
    """One kernel call takes one gradient dtype: split a bucket's active parameters by
    the dtype of their gradients (normally a single dtype, and no split)."""
    dtypes = set(map(_dtype_of, call.grads))
    parts = []
    for dtype in sorted(dtypes, key=str):
        keep = [k for k, g in enumerate(call.grads) if g.dtype == dtype]
        parts.append(
            FusedCall(
                call.bucket,
                call.group,
                [call.active[k] for k in keep],
                [call.grads[k] for k in keep],
                call.gi,
            )
        )
    return parts


_dtype_of = operator.attrgetter("dtype")
