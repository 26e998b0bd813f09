"""Gradient statistics and clipping across the buckets of one step: the orchestration of
the native statistics operators (``hierarchical_stats``) and the tensor-operation norm
(``max_grad_norm`` alone). The reduction order is Note [Statistics row] in
csrc/grad_stats.h; scopes are Note [Scopes] in ruda_torch/distributed.py."""

from __future__ import annotations

import torch

from . import _C, ops
from ._common import local
from .distributed import Scope, fold_over, globalize_report, globalize_sum
from .stats_plan import StatsPlan


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, ready to be read there by the next operation.

    Non-blocking only towards a CUDA device, where the copy is ordered on the stream
    before the kernels that read it. Towards the CPU a non-blocking copy returns before
    the data has arrived, and the CPU kernels (and the generic path) would read it at
    once: that copy waits (the one host sync of an optimizer with both CPU and CUDA
    buckets, which cannot decide a CPU step without the CUDA value)."""
    return t.to(device, non_blocking=device.type == "cuda")


class PerDevice:
    """Copies of small control tensors on each device that needs them, made once a step."""

    def __init__(self):
        self._cache: dict = {}

    def get(self, t: torch.Tensor | None, device: torch.device):
        if t is None:
            return None
        if t.device == device:
            return t.reshape(-1) if t.dim() != 1 else t
        key = (id(t), device)
        if key not in self._cache:
            self._cache[key] = to_device(t, device).reshape(-1)
        return self._cache[key]


def gradient_report(
    calls, buckets, grad_scale, per_device: PerDevice, partition_group=None
) -> torch.Tensor:
    """One report over all active fused buckets: per bucket analyze + merge tree (split
    into several reports when a bucket has more than MAX_ROWS rows); a left fold per
    (device, scope), globalized over the scope's process groups; then a left fold across
    scopes and devices; last, the fold over ``partition_group`` (Note [Scopes]).
    ``buckets`` are all the plan's buckets, in order."""
    reports_by_device: dict = {}
    for call in calls:
        b = call.bucket
        rows, scratch = b.stats_buffers()
        pieces = b.row_pieces(call.active)
        out = reports_by_device.setdefault((b.device, b.scope), [])
        row_start = 0
        for lo, hi, n_rows in pieces:
            report = torch.empty(3, dtype=torch.float32, device=b.device)
            piece_rows = rows[row_start : row_start + n_rows]
            scale = per_device.get(grad_scale, b.device)
            if call.flat:  # the handle's table, kept on the device (Note [Flat gradient buckets])
                every = len(call.active) == len(b.params)
                _C.flat_analyze(b.handle(), None if every else call.active, lo, hi, scale,
                                piece_rows)  # fmt: skip
            else:
                ops.analyze_gradient(call.grads[lo:hi], piece_rows, scale)
            StatsPlan(n_rows).reduce(piece_rows, scratch, report)
            row_start += n_rows
            out.append(report)
    # Every rank takes part in the same all-gathers in the same order, active gradients
    # or not: keys in bucket order, and every scope with a group present.
    order = []
    for b in buckets:
        key = (b.device, b.scope)
        if key not in order and (b.scope.groups or key in reports_by_device):
            order.append(key)
    partial = []
    for dev, scope in order:
        reports = reports_by_device.get((dev, scope), [])
        final = torch.empty(3, dtype=torch.float32, device=dev)
        if reports:
            ops.merge_gradient_stats_chunks(torch.stack(reports), final)
        else:
            final.zero_()
        partial.append(globalize_report(final, scope))
    if not partial:
        dev = buckets[0].device if buckets else torch.device("cpu")
        final = torch.zeros(3, dtype=torch.float32, device=dev)
    elif len(partial) == 1:
        final = partial[0]
    else:
        first = partial[0].device
        final = torch.empty(3, dtype=torch.float32, device=first)
        gathered = torch.stack([to_device(r, first) for r in partial])
        ops.merge_gradient_stats_chunks(gathered, final)
    if partition_group is not None:  # ranks that own other parts of the model
        final = fold_over(final, partition_group)
    return final


_DOUBLE = (torch.float64, torch.complex128)


def _square_norm(g: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """||g||^2 as a ``dtype`` scalar on ``device``. FP32 and 16-bit gradients are summed in
    FP32; FP64 and complex ones in their own precision (vector_norm cannot lower it)."""
    if g.dtype in (torch.float32, torch.float16, torch.bfloat16):
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
    else:
        norm = torch.linalg.vector_norm(g)
    return norm.to(device, dtype).square()


def tensor_norm_clip(max_grad_norm, fused_calls, generic, buckets, grad_scale, partition_group):
    """clip_grad_norm_'s coefficient from a tensor-operation norm (no native stats).
    ``generic`` is a list of (scope, gradient) of the generic path, and the scope of every
    parameter of the generic groups with or without a gradient, in order: the scopes'
    sums are reduced in one order on every rank (the plan's buckets, then those), whatever
    gradients a rank holds, and last summed over ``partition_group`` (Note [Scopes])."""
    generic_grads, generic_scopes = generic
    by_scope: dict = {}
    for b in buckets:
        if b.scope.groups:
            by_scope.setdefault(b.scope, [])
    for scope in generic_scopes:
        if scope.groups:
            by_scope.setdefault(scope, [])
    for c in fused_calls:
        by_scope.setdefault(c.bucket.scope, []).extend(c.grads)
    for scope, g in generic_grads:
        by_scope.setdefault(scope, []).append(local(g))
    if not by_scope and partition_group is None:
        return None
    grads = [g for gs in by_scope.values() for g in gs]
    if grads:
        first = grads[0].device
    else:
        first = buckets[0].device if buckets else torch.device("cpu")
    # FP64 (as clip_grad_norm_) where any gradient is FP64: FP64 parameters are clipped by
    # that coefficient on either path (the fused kernel of an FP64 bucket reads it in FP64),
    # the others by its FP32 rounding, as clip_grad_norm_'s in-place product rounds it.
    acc = torch.float64 if any(g.dtype in _DOUBLE for g in grads) else torch.float32
    squares = [torch.zeros((), dtype=acc, device=first)]
    for scope, gs in by_scope.items():
        sq = torch.zeros((), dtype=acc, device=first)
        for g in gs:
            sq = sq + _square_norm(g, first, acc)
        squares.append(globalize_sum(sq, scope))
    total = torch.stack(squares).sum()
    if partition_group is not None:
        total = globalize_sum(total, Scope((partition_group,)))
    total = total.sqrt()
    if grad_scale is not None:
        total = total / grad_scale.to(first).reshape(())
    return (max_grad_norm / (total + 1e-6)).clamp(max=1.0).reshape(1)
