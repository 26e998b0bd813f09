"""Which ranks share a parameter's gradient, and the global report across them.

Note [Scopes]
A bucket's *scope* is the tuple of process groups across which its parameters are
sharded, so that the global sum of squares is the sum of every rank's shard:
* FSDP2 / DTensor parameters: one group per mesh dimension with a ``Shard`` placement
  (``Replicate`` dimensions hold copies, which are counted once, i.e. not reduced);
* plain tensors (FSDP1 ``FlatParameter`` shards, ``use_orig_params`` views) when the
  optimizer was given ``process_group``: that group;
* anything else (single process, DDP's replicated parameters whose gradients are already
  all-reduced): no group, the local report is the global one.
For each scope, the local 12-byte report is all-gathered over each group in turn and the
gathered reports are folded in rank order by ``merge_gradient_stats_chunks``, so every
rank computes the same bits. Different scopes are then folded in bucket order.
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


def _ranks(group) -> tuple[int, ...]:
    return tuple(_dist().get_process_group_ranks(group))


class Scope:
    """A tuple of process groups; equal scopes have the same member ranks per group."""

    __slots__ = ("groups", "key")

    def __init__(self, groups: tuple = ()):
        self.groups = groups
        self.key = tuple(_ranks(g) for g in groups)

    def __eq__(self, other) -> bool:
        return isinstance(other, Scope) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def describe(self) -> str:
        if not self.groups:
            return "local (no process group)"
        return " x ".join(f"group of ranks {list(k)}" for k in self.key)


LOCAL = Scope(())


def scope_of(p: torch.Tensor, process_group, needs_global: bool, where: str) -> Scope:
    """The scope of one parameter (Note [Scopes]); raises ValueError for a setup that
    would silently give a local norm or disagree with the parameter's mesh."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is not None:
        groups = []
        for dim, placement in enumerate(p.placements):
            if placement.is_shard():
                groups.append(mesh.get_group(dim))
            elif placement.is_partial():
                raise ValueError(f"{where} has a Partial placement; reduce it before the step")
        scope = Scope(tuple(groups))
        if process_group is not None and needs_global:
            given = Scope((process_group,))
            if scope != given:
                raise ValueError(
                    f"process_group (ranks {list(given.key[0])}) does not match the mesh of "
                    f"{where}, which is sharded over {scope.describe()}; for DTensor "
                    "parameters the group comes from the mesh, so pass process_group=None"
                )
        return scope
    if process_group is not None:
        return Scope((process_group,))
    if needs_global and is_fsdp1_shard(p):
        raise ValueError(
            f"{where} is an FSDP1 flat-parameter shard but no process group is known, so "
            "the gradient norm would be only this rank's: pass process_group= (the FSDP "
            "process group) to ruda_torch.AdamW"
        )
    return LOCAL


def globalize_report(report: torch.Tensor, scope: Scope) -> torch.Tensor:
    """All-gather a 3-float report over each group of the scope and fold in rank order."""
    dist = _dist()
    for group in scope.groups:
        world = dist.get_world_size(group)
        if world == 1:
            continue
        gathered = [torch.empty_like(report) for _ in range(world)]
        dist.all_gather(gathered, report, group=group)
        merged = torch.empty_like(report)
        ops.merge_gradient_stats_chunks(torch.stack(gathered), merged)
        report = merged
    return report


def globalize_sum(value: torch.Tensor, scope: Scope) -> torch.Tensor:
    """Sum a tensor over each group of the scope (the tensor-operation norm path)."""
    dist = _dist()
    for group in scope.groups:
        dist.all_reduce(value, group=group)
    return value
