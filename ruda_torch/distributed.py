"""Which ranks share a parameter's gradient, and the global report across them.

Note [Scopes]
A bucket's *scope* says over which process groups the gradient report of its parameters
must be combined so that every rank gets the report of the whole model:
* ``shards``: groups across which the parameters are *split*; the global sum of squares
  is the sum of every member's part (reports folded in rank order);
* ``copies``: groups across which the parameters are *replicated*; every member holds a
  copy, counted once: the members' reports are combined by their elementwise maximum,
  which is the report itself where the copies are equal (as data parallelism keeps them)
  and, where they are not (a non-finite element in one copy), still one answer on every
  rank that skips if any copy would.
Where a scope comes from:
* DTensor parameters (FSDP2, HSDP, tensor parallelism, any mix): one group per mesh
  dimension of size > 1. What a placement *means* decides: ``Replicate`` is the only
  placement that holds copies; every other placement (``Shard``, ``_StridedShard``, which
  torch 2.13 no longer reports through ``is_shard()``, and whatever torch adds next)
  splits the parameter over its dimension, so a new placement is counted as a split by
  default; ``Partial`` holds unreduced summands and is refused (reduce it first).
* plain tensors (FSDP1 ``FlatParameter`` shards, ``use_orig_params`` views) when the
  optimizer was given ``process_group``: that group, as shards;
* anything else (single process, DDP's replicated parameters whose gradients are already
  all-reduced): no group, the local report is the global one.
Each (device, scope) report is combined over the scope's shard groups, then its copy
groups, each group in mesh-dimension order; the scopes of a rank are then folded in bucket
order (the same on every rank of a mesh, whose members hold the same structure). Last,
``partition_group`` (ranks that own *disjoint parts* of the model: ZeRO partitions,
pipeline stages) folds every rank's whole report in rank order; it must share no rank
but the caller's with the groups above, or the same parts would be summed twice.
"""

from __future__ import annotations

import torch

from . import ops


def _dist():
    import torch.distributed as dist

    return dist


def is_fsdp1_shard(p: torch.Tensor) -> bool:
    """FSDP1 FlatParameter shards and the views of use_orig_params=True."""
    return bool(getattr(p, "_is_flat_param", False) or getattr(p, "_fsdp_flattened", False))


def ranks_of(group, what: str = "process group") -> tuple[int, ...]:
    """The global ranks of ``group``; a clear error for one that is not (or no longer)
    registered, instead of torch's bare KeyError."""
    dist = _dist()
    if not dist.is_initialized():
        raise ValueError(
            f"{what} was given but torch.distributed is not initialized (or was destroyed): "
            "call torch.distributed.init_process_group first, or pass None"
        )
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (KeyError, RuntimeError, ValueError) as e:
        raise ValueError(
            f"{what} {group!r} is not a registered process group of this process (destroyed, "
            f"or made by another default group): {type(e).__name__}: {e}"
        ) from e


def check_process_group(group, name: str = "process_group") -> None:
    """``None`` or a registered ``torch.distributed.ProcessGroup``."""
    if group is None:
        return
    dist = _dist()
    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    ranks_of(group, name)  # registered, and torch.distributed still initialized


def _size(group) -> int:
    return _dist().get_world_size(group)


class Scope:
    """Groups over which gradients are split (``shards``) and copied (``copies``); equal
    scopes have the same member ranks per group (Note [Scopes])."""

    __slots__ = ("shards", "copies", "key")

    def __init__(self, shards: tuple = (), copies: tuple = ()):
        self.shards = shards
        self.copies = copies
        self.key = (tuple(ranks_of(g) for g in shards), tuple(ranks_of(g) for g in copies))

    @property
    def groups(self) -> tuple:
        """Every group of the scope (empty: a local scope, no collective)."""
        return self.shards + self.copies

    def __eq__(self, other) -> bool:
        return isinstance(other, Scope) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def describe(self) -> str:
        if not self.groups:
            return "local (no process group)"
        parts = [f"split over ranks {list(k)}" for k in self.key[0]]
        parts += [f"copied over ranks {list(k)}" for k in self.key[1]]
        return " x ".join(parts)


LOCAL = Scope()


def mesh_scope(p: torch.Tensor, where: str) -> Scope:
    """The scope of a DTensor from what each placement means (Note [Scopes])."""
    mesh = p.device_mesh
    shards, copies = [], []
    for dim, placement in enumerate(p.placements):
        if placement.is_partial():
            raise ValueError(
                f"{where} has a Partial placement on mesh dimension {dim} (unreduced "
                "summands): reduce it (redistribute to Shard or Replicate) before the step"
            )
        if mesh.size(dim) == 1:
            continue  # one member: nothing to combine
        (copies if placement.is_replicate() else shards).append(mesh.get_group(dim))
    return Scope(tuple(shards), tuple(copies))


def scope_of(p: torch.Tensor, process_group, needs_global: bool, where: str,
             partition_group=None) -> Scope:  # fmt: skip
    """The scope of one parameter (Note [Scopes]); raises ValueError for a setup that
    would silently give a local norm, count a part twice or disagree with the mesh."""
    if getattr(p, "device_mesh", None) is not None:
        scope = mesh_scope(p, where)
        if process_group is not None and needs_global:
            ranks = ranks_of(process_group)
            if scope.key[0] != ((ranks,) if len(ranks) > 1 else ()):
                raise ValueError(
                    f"process_group (ranks {list(ranks)}) does not match the mesh of "
                    f"{where}, which is {scope.describe()}; for DTensor parameters the "
                    "groups come from the mesh, so pass process_group=None (ranks that hold "
                    "other parts of the model, such as pipeline stages, go in "
                    "partition_group)"
                )
    elif process_group is not None and _size(process_group) > 1:
        scope = Scope((process_group,))
    else:
        if needs_global and partition_group is None and is_fsdp1_shard(p):
            raise ValueError(
                f"{where} is an FSDP1 flat-parameter shard but no process group is known, "
                "so the gradient norm would be only this rank's: pass process_group= (the "
                "FSDP process group) to ruda_torch.AdamW"
            )
        scope = LOCAL
    if needs_global and partition_group is not None:
        check_disjoint(scope, partition_group, where)
    return scope


def check_disjoint(scope: Scope, partition_group, where: str) -> None:
    """``partition_group`` sums whole reports: it must not contain another member of a
    group that the scope already combines (that member's part would count twice)."""
    me = _dist().get_rank()
    part = set(ranks_of(partition_group, "partition_group"))
    for ranks in (*scope.key[0], *scope.key[1]):
        shared = sorted((part & set(ranks)) - {me})
        if shared:
            raise ValueError(
                f"partition_group (ranks {sorted(part)}) shares ranks {shared} with a group "
                f"over which {where} is already {scope.describe()}: partition_group joins "
                "ranks that own different parts of the model (pipeline stages, ZeRO "
                "partitions), never ranks of one mesh dimension or process_group"
            )


def _gather(report: torch.Tensor, group) -> torch.Tensor | None:
    """The reports of every member of ``group`` in rank order, or None for one member."""
    dist = _dist()
    world = dist.get_world_size(group)
    if world == 1:
        return None
    gathered = [torch.empty_like(report) for _ in range(world)]
    dist.all_gather(gathered, report, group=group)
    return torch.stack(gathered)


def fold_over(report: torch.Tensor, group) -> torch.Tensor:
    """The left fold in rank order of the members' reports (the sum over parts)."""
    gathered = _gather(report, group)
    if gathered is None:
        return report
    merged = torch.empty_like(report)
    ops.merge_gradient_stats_chunks(gathered, merged)
    return merged


def globalize_report(report: torch.Tensor, scope: Scope) -> torch.Tensor:
    """Combine a 3-float report over the scope: folded over each shard group, then the
    elementwise maximum over each copy group (Note [Scopes])."""
    for group in scope.shards:
        report = fold_over(report, group)
    for group in scope.copies:
        gathered = _gather(report, group)
        if gathered is not None:
            report = gathered.amax(dim=0)
    return report


def globalize_sum(value: torch.Tensor, scope: Scope) -> torch.Tensor:
    """Sum a tensor over each shard group of the scope and take the maximum over each copy
    group (the tensor-operation norm path)."""
    dist = _dist()
    for group in scope.shards:
        dist.all_reduce(value, group=group)
    for group in scope.copies:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return value
