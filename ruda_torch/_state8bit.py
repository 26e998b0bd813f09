"""Everything that knows the 8-bit state format (state_precision="8bit"): which buckets
hold 8-bit moments, the codes/scales pairs of the state entries and their checks, DTensor
entries, and the conversion to torch's format. A new state format is a sibling file."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from . import ops
from ._build import BLOCK_8BIT
from ._common import (
    EIGHT_BIT_KEYS,
    MIN_8BIT_SIZE,
    STATE_KEYS,
    check_shape,
    codes_key,
    is_dense,
    local,
    own,
    scales_key,
)

# Note [8-bit buckets]
# With state_precision="8bit" a parameter of at least ``min_8bit_size`` elements (a group
# option, 4,096 by default; the whole parameter's count, so that every rank of a sharded
# one decides alike) keeps its moments as blockwise 8-bit codes (Note [8-bit moments] in
# csrc/quant8.h): its bucket's moment buffers are uint8 codes, every slot starting a
# block, and one FP32 buffer ``scales`` holds each moment's scales in turn, one per block
# (a storage apart from the codes: torch.save refuses two dtypes over one storage).
# Smaller parameters (biases, norms: a sliver of the memory, and the ones whose few blocks
# quantize worst) keep FP32 moments in a bucket of their own, as bitsandbytes' (its
# ``min_8bit_size``) and torchao's 8-bit optimizers do below 4,096 elements. The state
# entries hold each moment as a codes/scales pair (Note [8-bit state entries] below).


def bucket_precision(p: torch.Tensor, group: dict) -> str:
    """The moment storage of ``p``'s bucket in ``group`` (Note [8-bit buckets])."""
    precision = group.get("state_precision", "fp32")
    if precision == "8bit" and p.numel() < group.get("min_8bit_size", MIN_8BIT_SIZE):
        return "fp32"
    return precision


def moment_code(key: str) -> str:
    """The 8-bit code of a moment (ops.CODES_8BIT): signed for the first, unsigned for the
    squares."""
    return "signed" if key == "exp_avg" else "unsigned"


# Note [8-bit state entries]
# A moment stored in 8 bits (state_precision="8bit", Note [8-bit moments] in
# csrc/quant8.h) is not a tensor of values: it is a pair, `<moment>_codes` (uint8, shaped
# like the parameter, laid out in memory as the kernel steps it) and `<moment>_scales`
# (FP32, one per block of 256 codes in the codes' memory order), in place of `<moment>`.
# The names differ from torch's on purpose: torch.optim.AdamW casts every state tensor
# it loads to the parameter's dtype, so codes under torch's name would load there as
# values 0..255 and step silently wrong; under their own names torch's step stops with
# KeyError 'exp_avg' instead, and ruda_torch.dequantize_state_dict converts.


def blocks_8bit(numel: int) -> int:
    return -(-numel // BLOCK_8BIT)


def moment_format(entry, key: str, where: str) -> str | None:
    """How ``entry`` holds moment ``key``: ``"plain"`` (a tensor of values), ``"8bit"``
    (Note [8-bit state entries]) or None (absent). Raises for half a pair, or both forms."""
    pair = (codes_key(key), scales_key(key))
    has = [k in entry for k in pair]
    if has[0] != has[1]:
        present, missing = pair if has[0] else pair[::-1]
        raise ValueError(
            f"{where} has {present!r} without {missing!r}: an 8-bit moment is the pair "
            f"{pair[0]!r} (uint8 codes) and {pair[1]!r} (float32 block scales)"
        )
    if has[0] and key in entry:
        raise ValueError(
            f"{where} holds both {key!r} and its 8-bit form {pair[0]!r}/{pair[1]!r}: keep one "
            f"(delete the other), so that the step knows which is the moment"
        )
    return "8bit" if has[0] else "plain" if key in entry else None


def check_8bit(entry, p: torch.Tensor, key: str, where: str) -> None:
    """The pair of Note [8-bit state entries]: uint8 codes shaped like ``p`` whose local
    tensor is dense (its memory order defines the blocks), and FP32 scales with one value
    per block of the local codes (at least one: a DTensor's local scales are padded to
    the largest shard's blocks, Note [8-bit DTensor state] in ruda_torch/_state8bit.py)."""
    ck, sk = codes_key(key), scales_key(key)
    codes, scales = entry[ck], entry[sk]
    for k, v in ((ck, codes), (sk, scales)):
        if not isinstance(v, torch.Tensor) or v.is_meta:
            got = "a meta tensor" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"{where}[{k!r}] must be a tensor with values, got {got}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"{where}[{ck!r}] must be uint8 (8-bit codes), got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise ValueError(f"{where}[{sk!r}] must be float32 (block scales), got {scales.dtype}")
    check_shape(codes, p, ck, where)
    lc, ls = local(codes), local(scales)
    if not is_dense(lc):
        raise ValueError(
            f"{where}[{ck!r}] is not dense (strides {lc.stride()}): the blocks of 8-bit codes "
            "follow their memory order, which a view with gaps does not have"
        )
    need = blocks_8bit(lc.numel())
    padded = ls is not scales  # a DTensor's local scales
    if not ls.is_contiguous() or ls.numel() < need or (not padded and ls.numel() != need):
        raise ValueError(
            f"{where}[{sk!r}] must be a contiguous float32 tensor of {need} scale(s), one per "
            f"block of {BLOCK_8BIT} codes, got shape {tuple(ls.shape)}"
        )


def moment_values(values: dict, key: str) -> torch.Tensor | None:
    """Moment ``key`` of an adopted entry's (local) values as a tensor of values shaped
    like the parameter: the tensor itself, or its 8-bit pair decoded (FP32), or None."""
    if key in values:
        return values[key]
    codes = values.get(codes_key(key))
    if codes is None:
        return None
    n = codes.numel()
    decoded = torch.empty(n, dtype=torch.float32, device=codes.device)
    scales = values[scales_key(key)].reshape(-1)[: blocks_8bit(n)]
    ops.dequantize_8bit(own(codes, 0, (n,)), scales, moment_code(key), out=decoded)
    return decoded.as_strided(codes.shape, codes.stride())  # the codes' memory order


def dequantize_state_dict(state_dict: dict) -> dict:
    """An optimizer state dict with every 8-bit moment (``state_precision="8bit"``, Note
    [8-bit state entries] in ruda_torch/_state8bit.py) replaced by its FP32 values under
    torch's name, shaped and laid out like its codes: torch.optim.AdamW's format, which
    torch's AdamW (and ours with any ``state_precision``) loads. Everything else is shared
    with the input, which is not modified. DTensor entries (an FSDP2 sharded state dict)
    are converted shard by shard, into DTensors with the codes' placements."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("state"), Mapping):
        raise ValueError(
            "dequantize_state_dict takes an optimizer state dict (a dict with 'state' and "
            f"'param_groups', as optimizer.state_dict() returns), got {type(state_dict).__name__}"
        )
    return dequantize_entries(state_dict)


def dequantize_entries(state_dict: dict, only: set | None = None) -> dict:
    """dequantize_state_dict for the entries of the parameter indices in ``only`` (all by
    default)."""
    state = {}
    for index, entry in state_dict["state"].items():
        if (
            (only is not None and index not in only)
            or not isinstance(entry, Mapping)
            or not any(k in entry for k in EIGHT_BIT_KEYS)
        ):
            state[index] = entry
            continue
        where = f"state_dict['state'][{index!r}]"
        new = {k: v for k, v in entry.items() if k == "step"}
        for key in STATE_KEYS:
            if moment_format(entry, key, where) == "8bit":
                codes = entry[codes_key(key)]
                check_8bit(entry, codes, key, where)  # against the codes' own shape
                new[key] = _decoded(codes, entry[scales_key(key)], key)
        new.update((k, v) for k, v in entry.items() if k not in new and k not in EIGHT_BIT_KEYS)
        state[index] = new
    return {**state_dict, "state": state}


def _decoded(codes: torch.Tensor, scales: torch.Tensor, key: str) -> torch.Tensor:
    values = moment_values({codes_key(key): local(codes), scales_key(key): local(scales)}, key)
    if not hasattr(codes, "device_mesh"):
        return values
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(values, codes.device_mesh, codes.placements, run_check=False,
                              shape=codes.shape, stride=codes.stride())  # fmt: skip


# Note [8-bit DTensor state]
# An 8-bit moment of a DTensor parameter (FSDP2, HSDP, tensor parallel) is a codes DTensor
# with the parameter's mesh and placements around the local codes, and a scales DTensor
# of shape (m_1, ..., m_k, B): one row of B scales per shard, m_j the mesh size along
# dimension j where the parameter is sharded (Shard(j) there) and 1 where it is
# replicated (Replicate there). B is the block count of the largest shard (ceil-divided
# sizes, torch.chunk's), so that every rank's local scales have one shape; a smaller
# shard's row ends in zeros. The blocks follow each rank's local memory order, which only
# the same sharding reproduces: distributed checkpoints (DCP) of this state load exactly
# on the same mesh, and a different number of ranks changes (m_1, ..., m_k), which DCP
# refuses as a size mismatch instead of loading scales of other blocks.
def slot_numel(p: torch.Tensor, t: torch.Tensor) -> int:
    """The elements a slot reserves for ``p`` (local ``t``): the largest shard's for a
    DTensor (Note [8-bit DTensor state])."""
    if not hasattr(p, "device_mesh"):
        return t.numel()
    shape = list(p.shape)
    for j, placement in enumerate(p.placements):
        if placement.is_shard():
            d = placement.dim
            shape[d] = -(-shape[d] // p.device_mesh.size(j))
    largest = 1
    for n in shape:
        largest *= n
    if t.numel() > largest:
        raise ValueError(
            f"a DTensor parameter of shape {tuple(p.shape)} with placements {p.placements} has "
            f"a local shard of {t.numel()} elements, more than the {largest} of ceil-divided "
            "shards that 8-bit moments reserve: use state_precision='bf16' or 'fp32' for it"
        )
    return largest


def wrap_scales(scales: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The scales of an 8-bit moment as the entry holds them: the 1-D tensor itself, or
    for a DTensor parameter a DTensor of one row per shard (Note [8-bit DTensor state])."""
    if not hasattr(p, "device_mesh"):
        return scales
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = p.device_mesh
    sharded = [pl.is_shard() for pl in p.placements]
    shape = (*(mesh.size(j) if s else 1 for j, s in enumerate(sharded)), scales.numel())
    placements = [Shard(j) if s else Replicate() for j, s in enumerate(sharded)]
    local_rows = scales.view(*(1 for _ in sharded), scales.numel())
    return DTensor.from_local(local_rows, mesh, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())  # fmt: skip
