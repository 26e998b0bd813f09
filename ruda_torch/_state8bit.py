"""Everything that knows the 8-bit state format (state_precision="8bit"): which buckets
hold 8-bit moments, the codes/scales pairs of the state entries and their checks, DTensor
entries, and the conversion to torch's format. A new state format is a sibling file."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from . import ops
from ._build import BLOCK_4BIT, BLOCK_8BIT
from ._common import (
    CODED_KEYS,
    MIN_8BIT_SIZE,
    STATE_KEYS,
    check_shape,
    codes4_key,
    codes_key,
    entry_names,
    entry_where,
    found,
    is_dense,
    local,
    own,
    scales4_key,
    scales_key,
)
from ._state4bit import FORMAT as FOUR
from ._state4bit import check_4bit, decoded_4bit

# Note [8-bit buckets]
# With state_precision="8bit" a parameter of at least ``min_8bit_size`` elements (a group
# option, 4,096 by default; the whole parameter's count, so that every rank of a sharded
# one decides alike) keeps its moments as blockwise 8-bit codes (Note [8-bit moments] in
# csrc/quant8.h): its bucket's moment buffers are uint8 codes, one per element, every slot
# starting at a multiple of 256, and one FP32 buffer ``scales`` holds a run of scales per
# moment (a storage apart from the codes: torch.save refuses two dtypes over one storage):
# a slot's at its offset / 256 where its rows are whole blocks, else after those (Note
# [8-bit row blocks] in csrc/quant8.h). A 1-D DTensor parameter keeps FP32 moments (Note
# [8-bit blocks on every mesh]).
# Smaller parameters (biases, norms: a sliver of the memory, and the ones whose few blocks
# quantize worst) keep FP32 moments in a bucket of their own, as bitsandbytes' (its
# ``min_8bit_size``) and torchao's 8-bit optimizers do below 4,096 elements. The state
# entries hold each moment as a codes/scales pair (Note [8-bit state entries] below).


def bucket_precision(p: torch.Tensor, group: dict) -> str:
    """The moment storage of ``p``'s bucket in ``group`` (Note [8-bit buckets]; a sharded
    1-D parameter keeps FP32 moments: Note [8-bit blocks on every mesh]; 4 bits where the
    last dimension pairs its elements, else 8: Note [4-bit buckets] in
    ruda_torch/_state4bit.py)."""
    precision = group.get("state_precision", "fp32")
    if precision in ("8bit", "4bit") and (
        p.numel() < group.get("min_8bit_size", MIN_8BIT_SIZE)
        or (p.dim() < 2 and hasattr(p, "device_mesh"))
    ):
        return "fp32"
    if precision == "4bit" and not (p.dim() >= 1 and p.shape[-1] % 2 == 0):
        return "8bit"
    return precision


def moment_code(key: str) -> str:
    """The 8-bit code of a moment (ops.CODES_8BIT): signed for the first, unsigned for the
    squares."""
    return "signed" if key == "exp_avg" else "unsigned"


# Note [8-bit state entries]
# A moment stored in 8 bits (state_precision="8bit", Note [8-bit moments] in
# csrc/quant8.h) is not a tensor of values: it is a pair, `<moment>_codes` (uint8, shaped
# like the parameter) and `<moment>_scales` (FP32, one per block: Note [8-bit row blocks]
# in csrc/quant8.h, shape ops.scales_shape_8bit(parameter shape), the rows' blocks in
# order), in place of `<moment>`: what ops.quantize_8bit returns for the moment's values.
# The codes' strides do not matter: the blocks are defined on the shape (a bucket keeps
# the codes of its slot contiguous, one per element). An entry of the earlier format
# (scales of one dimension, one per block of 256 codes in the codes' memory order, for a
# parameter of two or more dimensions; on a mesh, one row of scales per shard) still
# loads: converted where its blocks are not the rows' (Note [8-bit blocks on every
# mesh]); which format an entry is in is decided exactly (Note [8-bit entry formats]).
# The names differ from torch's on purpose: torch.optim.AdamW casts every state tensor
# it loads to the parameter's dtype, so codes under torch's name would load there as
# values 0..255 and step silently wrong; under their own names torch's step stops with
# KeyError 'exp_avg' instead, and ruda_torch.dequantize_state_dict converts.


def blocks_8bit(numel: int) -> int:
    return -(-numel // BLOCK_8BIT)


def moment_format(entry, key: str, where: str) -> str | None:
    """How ``entry`` holds moment ``key``: ``"plain"`` (a tensor of values), ``"8bit"``
    (Note [8-bit state entries]), ``"4bit"`` (Note [4-bit state entries] in
    ruda_torch/_state4bit.py) or None (absent). Raises for half a pair, or two forms."""
    forms = []
    for form, pair in (("8bit", (codes_key(key), scales_key(key))),
                       ("4bit", (codes4_key(key), scales4_key(key)))):  # fmt: skip
        has = [k in entry for k in pair]
        if has[0] != has[1]:
            present, missing = pair if has[0] else pair[::-1]
            raise ValueError(
                f"{where} has {present!r} without {missing!r}: a {form[0]}-bit moment is the "
                f"pair {pair[0]!r} (uint8 codes) and {pair[1]!r} (float32 block scales)"
            )
        if has[0]:
            forms.append((form, f"its {form[0]}-bit form {pair[0]!r}/{pair[1]!r}"))
    if key in entry:
        forms.insert(0, ("plain", repr(key)))
    if len(forms) > 1:
        raise ValueError(
            f"{where} holds both "
            + " and ".join(text for _, text in forms)
            + ": keep one (delete the other), so that the step knows which is the moment"
        )
    return forms[0][0] if forms else None


# Note [8-bit entry formats]
# Which format an 8-bit pair is in is decided from the shapes, dtypes and layouts of its
# codes and scales together (the codes being shaped like the parameter, and placed like it
# or as a checkpoint was read), exactly: never from "at least as many scales as blocks",
# under which the row scales of a (64, 80) parameter flattened to (64,) were read as the
# 20 blocks of another format. Two formats exist:
# * "rows" (Note [8-bit state entries]): scales of global shape
#   ops.scales_shape_8bit(codes.shape), contiguous; for DTensor codes a DTensor on their
#   mesh with their placements whose local shape is scales_shape_8bit(local codes' shape)
#   (the shards hold whole rows). The codes may have any strides: the blocks are defined
#   on the shape, and codes are read by position, as moments of values are;
# * "first" (the first release's, up to commit bc46cce; Note [Checkpoint templates] in
#   ruda_torch/_checkpoint.py): blocks of 256 codes in the local codes' memory order, so
#   the codes must be dense; the scales of plain codes of two or more dimensions 1-D, one
#   per block, and of DTensor codes a DTensor of shape (m_1, ..., m_k, B), one row per
#   shard: m_j the mesh size along mesh dimension j where the codes are sharded and 1
#   elsewhere, B the blocks of the largest shard (ceil-divided sizes, torch.chunk's),
#   placements Shard(j) and Replicate, local shape (1, ..., 1, B).
# Anything else is refused before any write, with the key, the shape found and the shapes
# accepted. The two formats' shapes coincide only where their blocks do (one row): either
# reading gives the same values. They cannot tell a user's reshaping from a real entry of
# the other format: 1-D scales of a plain 2-D parameter are the first format's, which is
# what a reshaped row scale of a (3, 200) parameter then reads as.
def scales_layouts(codes: torch.Tensor) -> dict[str, tuple[tuple, tuple, list | None]]:
    """The layouts the scales of 8-bit ``codes`` may have (Note [8-bit entry formats]), by
    format: ``(global shape, local shape, placements or None)``, placements None for plain
    codes. "first" only where it differs from "rows" or is a DTensor's."""
    shape, local_shape = tuple(codes.shape), tuple(local(codes).shape)
    rows = ops.scales_shape_8bit(shape)
    mesh = getattr(codes, "device_mesh", None)
    if mesh is None:
        out = {"rows": (rows, rows, None)}
        if len(shape) >= 2:
            flat = (blocks_8bit(math.prod(shape)),)
            out["first"] = (flat, flat, None)
        return out
    from torch.distributed.tensor import Replicate, Shard

    out = {"rows": (rows, ops.scales_shape_8bit(local_shape), list(codes.placements))}
    sharded = [pl.is_shard() for pl in codes.placements]
    largest = list(shape)
    for j, pl in enumerate(codes.placements):
        if sharded[j]:
            largest[pl.dim] = -(-largest[pl.dim] // mesh.size(j))
    per_shard = blocks_8bit(math.prod(largest))
    first = (*(mesh.size(j) if s else 1 for j, s in enumerate(sharded)), per_shard)
    placements = [Shard(j) if s else Replicate() for j, s in enumerate(sharded)]
    out["first"] = (first, (*(1 for _ in sharded), per_shard), placements)
    return out


def accepted_shapes(layouts: dict) -> str:
    """The shapes of ``layouts`` (scales_layouts) for a message."""
    return " or ".join(
        f"{shape}" + ("" if fmt == "rows" else " (the first 8-bit format's)")
        for fmt, (shape, _, _) in layouts.items()
    )


def check_8bit(entry, p: torch.Tensor, key: str, where: str) -> str:
    """The pair of moment ``key`` (Note [8-bit state entries]): uint8 codes shaped like
    ``p`` and FP32 scales of exactly one format's layout (Note [8-bit entry formats]);
    returns the format, "rows" or "first". Raises ValueError naming the key, what was
    found and what is accepted."""
    ck, sk = codes_key(key), scales_key(key)
    codes, scales = entry[ck], entry[sk]
    for k, v in ((ck, codes), (sk, scales)):
        if not isinstance(v, torch.Tensor) or v.is_meta:
            raise ValueError(f"{where}[{k!r}] must be a tensor with values, got {found(v)}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"{where}[{ck!r}] must be uint8 (8-bit codes), got {codes.dtype}")
    if scales.dtype != torch.float32:
        raise ValueError(f"{where}[{sk!r}] must be float32 (block scales), got {scales.dtype}")
    check_shape(codes, p, ck, where)
    layouts = scales_layouts(codes)
    mesh = getattr(codes, "device_mesh", None)
    lc, ls = local(codes), local(scales)
    got = tuple(scales.shape)
    for fmt, (shape, local_shape, placements) in layouts.items():
        if got != shape:
            continue
        if hasattr(scales, "device_mesh") and (
            scales.device_mesh != mesh or list(scales.placements) != placements
        ):
            where_placed = (f"on mesh {scales.device_mesh} with placements {scales.placements}"
                            if mesh is not None else "a DTensor")  # fmt: skip
            raise ValueError(
                f"{where}[{sk!r}] is {where_placed}, but the scales of "
                + (f"codes with placements {codes.placements} are placed {placements} on "
                   f"their mesh {mesh}" if mesh is not None else "plain codes are plain")
                + " (Note [8-bit entry formats] in ruda_torch/_state8bit.py)"
            )  # fmt: skip
        if tuple(ls.shape) != local_shape or not ls.is_contiguous():
            raise ValueError(
                f"{where}[{sk!r}] has local shape {tuple(ls.shape)}"
                f"{'' if ls.is_contiguous() else ' and is not contiguous'}; the scales of "
                f"local codes of shape {tuple(lc.shape)} are a contiguous tensor of shape "
                f"{local_shape} (Note [8-bit entry formats] in ruda_torch/_state8bit.py)"
            )
        if fmt == "first" and not is_dense(lc):
            raise ValueError(
                f"{where}[{ck!r}] has strides {lc.stride()} with scales of the first 8-bit "
                "format, whose blocks follow the codes' memory order, which a view with "
                "gaps does not have: give the codes dense (e.g. .contiguous() of the tensor "
                "they were saved from)"
            )
        return fmt
    raise ValueError(
        f"{where}[{sk!r}] has shape {got}; the scales of 8-bit codes of shape "
        f"{tuple(codes.shape)} have shape {accepted_shapes(layouts)}: one float32 scale per block "
        f"of up to {BLOCK_8BIT} codes of each row, as ruda_torch.ops.quantize_8bit makes them "
        "(Note [8-bit entry formats] in ruda_torch/_state8bit.py)"
    )


def pair_format(codes: torch.Tensor, scales: torch.Tensor) -> str:
    """The format of the local tensors of a pair that check_8bit accepted: "rows" where
    the scales are those of the local codes' rows, else "first" (where both would fit, the
    blocks are the same)."""
    rows = ops.scales_shape_8bit(codes.shape)
    return "rows" if tuple(scales.shape) == rows else "first"


def moment_values(values: dict, key: str) -> torch.Tensor | None:
    """Moment ``key`` of an adopted entry's (local) values as a tensor of values shaped
    like the parameter: the tensor itself, or its 8-bit or 4-bit pair decoded (FP32), or
    None."""
    if key in values:
        return values[key]
    if codes4_key(key) in values:
        return decoded_4bit(values[codes4_key(key)], values[scales4_key(key)], key)
    codes = values.get(codes_key(key))
    if codes is None:
        return None
    scales = values[scales_key(key)]
    if pair_format(codes, scales) == "rows":
        return ops.dequantize_8bit(codes, scales, moment_code(key))
    # The first format: blocks of the codes' memory order (a shard's row padded with more).
    n = codes.numel()
    decoded = torch.empty(n, dtype=torch.float32, device=codes.device)
    flat_scales = scales.reshape(-1)[: blocks_8bit(n)]
    ops.dequantize_8bit(own(codes, 0, (n,)), flat_scales, moment_code(key), out=decoded)
    return decoded.as_strided(codes.shape, codes.stride())  # the codes' memory order


def dequantize_state_dict(state_dict: dict) -> dict:
    """An optimizer state dict with every 8-bit moment (``state_precision="8bit"``, Note
    [8-bit state entries] in ruda_torch/_state8bit.py) replaced by its FP32 values under
    torch's name, shaped like its codes: torch.optim.AdamW's format, which
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
    names = entry_names(state_dict.get("param_groups"))
    for index, entry in state_dict["state"].items():
        if (
            (only is not None and index not in only)
            or not isinstance(entry, Mapping)
            or not any(k in entry for k in CODED_KEYS)
        ):
            state[index] = entry
            continue
        where = entry_where("state_dict['state']", index, names)
        new = {k: v for k, v in entry.items() if k == "step"}
        for key in STATE_KEYS:
            form = moment_format(entry, key, where)
            if form == "8bit":
                codes = entry[codes_key(key)]
                check_8bit(entry, codes, key, where)  # against the codes' own shape
                new[key] = decoded_pair(codes, entry[scales_key(key)], key)
            elif form == "4bit":
                codes = entry[codes4_key(key)]
                like = torch.empty(ops.shape_of_codes_4bit(codes.shape), device="meta")
                check_4bit(entry, _placed_like(like, codes), key, where)
                new[key] = decoded_4bit(codes, entry[scales4_key(key)], key)
        new.update((k, v) for k, v in entry.items() if k not in new and k not in CODED_KEYS)
        state[index] = new
    return {**state_dict, "state": state}


def _placed_like(like: torch.Tensor, codes: torch.Tensor):
    """A stand-in parameter of ``like``'s shape placed as ``codes`` (for check_4bit, which
    reads the parameter's shape, mesh and placements)."""
    if not hasattr(codes, "device_mesh"):
        return like

    class _Placed:
        shape, device_mesh, placements = like.shape, codes.device_mesh, codes.placements

        def dim(self):
            return len(self.shape)

    return _Placed()


def decoded_pair(codes: torch.Tensor, scales: torch.Tensor, key: str) -> torch.Tensor:
    """The FP32 values of 8-bit moment ``key``'s pair, decoded shard by shard: a DTensor
    with the codes' placements for DTensor codes."""
    values = moment_values({codes_key(key): local(codes), scales_key(key): local(scales)}, key)
    if not hasattr(codes, "device_mesh"):
        return values
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(values, codes.device_mesh, codes.placements, run_check=False,
                              shape=codes.shape, stride=codes.stride())  # fmt: skip


# Note [8-bit blocks on every mesh]
# The blocks of an 8-bit moment are the rows' (Note [8-bit row blocks] in csrc/quant8.h),
# defined on the parameter's global shape, so that a shard holds whole blocks and the
# scales of a DTensor parameter are a DTensor of shape ops.scales_shape_8bit(p.shape)
# with the parameter's mesh and placements: FSDP2's and HSDP's Shard(0) (and the
# _StridedShard(0) of FSDP2 over tensor parallelism) and Colwise tensor parallelism never
# cut a row, and the rows' scales shard with them. The codes and scales are then the same
# on every mesh, bit for bit, and a distributed checkpoint (DCP) reshards them like any
# other tensor: saved on 4 ranks, it loads on 2 or 1. Where a sharding would cut a block:
# * Shard(1) (Rowwise tensor parallelism) cuts each row; it is taken where every shard's
#   part of a row is a whole number of blocks (e.g. 4096 columns over 2, 4, 8 or 16 ranks)
#   and refused otherwise, with the parameter named (check_mesh_8bit), as is a Shard of a
#   later dimension, whose shards interleave the blocks of a row;
# * a 1-D DTensor parameter (a norm's weight, a bias) is one row that FSDP2 cuts wherever
#   its element count divides, so on some mesh any block would be cut: it keeps FP32
#   moments (bucket_precision), on every mesh alike. Norms and biases are a sliver of a
#   model's memory. A 1-D parameter that is a plain tensor (one process, FSDP1's flat
#   parameters, ZeRO) keeps 8-bit moments; its full state dict then differs from an FSDP2
#   run's in those entries' form, which load_state_dict converts either way.
def check_mesh_8bit(p: torch.Tensor, where: str, bits: int = 8) -> None:
    """Raises unless every shard of DTensor ``p`` holds whole blocks of its rows and its
    scales shard like it (Note [8-bit blocks on every mesh]; ``bits`` 4: the 4-bit
    format's blocks). Decided on the global shape, mesh sizes and placements: every rank
    decides alike."""
    if not hasattr(p, "device_mesh") or p.dim() < 2:
        return
    block = BLOCK_4BIT if bits == 4 else BLOCK_8BIT
    _, row = ops.rows_8bit(p.shape)
    per_row = -(-row // block)
    inner = row // p.shape[1] if p.shape[1] else 0
    problem = None
    # Shard-like placements (Shard, and _StridedShard, whose is_shard() is False) by the
    # dimension they cut.
    cuts = [(j, pl, pl.dim % p.dim()) for j, pl in enumerate(p.placements) if hasattr(pl, "dim")]
    dim1 = [(j, pl, d) for j, pl, d in cuts if d != 0]
    for j, pl, d in dim1:
        if d != 1 or type(pl).__name__ != "Shard" or len(dim1) > 1:
            problem = f"{pl!r} on mesh dimension {j} interleaves the blocks of a row"
            break
        m = p.device_mesh.size(j)
        chunk, scale_chunk = -(-p.shape[1] // m), -(-per_row // m)
        for k in range(m):
            size = max(0, min(chunk, p.shape[1] - k * chunk))
            blocks = max(0, min(scale_chunk, per_row - k * scale_chunk))
            if size and (
                (k * chunk * inner) % block
                or -(-size * inner // block) != blocks
                or (bits == 4 and p.dim() > 2)  # the codes' last dimension is not dimension 1
            ):
                problem = (f"{pl!r} on mesh dimension {j} cuts rows of {row} elements into parts "
                           f"of {chunk * inner}, not whole blocks of {block}")  # fmt: skip
                break
        if problem:
            break
    if problem:
        raise ValueError(
            f"{where}: state_precision='{bits}bit' keeps blocks of {block} consecutive elements "
            f"of each row (Note [8-bit blocks on every mesh] in ruda_torch/_state8bit.py), "
            f"and this parameter of shape {tuple(p.shape)} with placements {p.placements} "
            f"would cut them: {problem}. Give it state_precision='bf16' or 'fp32' (a param "
            "group of its own, or min_8bit_size above its element count), or shard it along "
            "its first dimension, or into parts of whole blocks"
        )


def blocks_of_8bit(t: torch.Tensor) -> int:
    """The scales of a local tensor's 8-bit moment: one per block of each row."""
    return math.prod(ops.scales_shape_8bit(t.shape))


def wrap_scales(scales: torch.Tensor, p: torch.Tensor, coded=None) -> torch.Tensor:
    """The scales of an 8-bit moment as the entry holds them (local ``scales`` of
    ops.scales_shape_8bit(local shape)): themselves, or for a DTensor parameter a DTensor
    of ops.scales_shape_8bit(p.shape) with its mesh and placements (Note [8-bit blocks on
    every mesh])."""
    if not hasattr(p, "device_mesh"):
        return scales
    from torch.distributed.tensor import DTensor

    shape = (coded or FORMAT).scales_shape(p.shape)
    return DTensor.from_local(scales, p.device_mesh, p.placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())  # fmt: skip


class EightBit:
    """What a bucket of 8-bit moments asks its format (Note [8-bit buckets]); the 4-bit
    sibling is ruda_torch/_state4bit.py's FourBit."""

    name = "8bit"
    block = BLOCK_8BIT
    state_dtype = torch.uint8
    per_byte = 1

    codes_key = staticmethod(codes_key)
    scales_key = staticmethod(scales_key)
    ragged_row = staticmethod(ops.ragged_row_8bit)
    scales_shape = staticmethod(ops.scales_shape_8bit)

    @staticmethod
    def codes_shape(shape) -> tuple:
        return tuple(shape)

    @staticmethod
    def check(entry, p: torch.Tensor, key: str, where: str) -> None:
        check_8bit(entry, p, key, where)

    @staticmethod
    def quantize(x: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.quantize_8bit(x, moment_code(key))

    @staticmethod
    def decoded(codes: torch.Tensor, scales: torch.Tensor, key: str) -> torch.Tensor:
        return decoded_pair(codes, scales, key)

    @staticmethod
    def same_blocks(codes: torch.Tensor, scales: torch.Tensor) -> bool:
        """Whether an accepted pair's local tensors copy into a slot as they are: the rows'
        blocks (or the first format's where they are the rows')."""
        return pair_format(codes, scales) == "rows" or (
            codes.is_contiguous() and not ops.ragged_row_8bit(codes.shape)
        )


FORMAT = EightBit()


def coded_format(precision: str):
    """The format object of a bucket's moment precision, or None for values (FP32, BF16)."""
    if precision == "8bit":
        return FORMAT
    if precision == "4bit":
        return FOUR
    return None
