"""Everything that knows the 4-bit state format (state_precision="4bit"): which parameters
take it, the codes/scales pairs of the state entries and their checks, DTensor entries,
and the conversion to values. The sibling of _state8bit.py; the buckets ask a format
object (``FORMAT``, and _state8bit.FORMAT) what they need to lay out and fill a slot."""

from __future__ import annotations

import torch

from . import ops
from ._build import BLOCK_4BIT
from ._common import codes4_key, found, local, scales4_key

# Note [4-bit buckets]
# With state_precision="4bit" a parameter of at least ``min_8bit_size`` elements (the one
# threshold of both low-bit formats, decided on the whole parameter's count) whose last
# dimension is even keeps its moments as blockwise 4-bit codes (Note [4-bit moments] in
# csrc/quant4.h): its bucket's moment buffers are int8 (two codes per byte, a marker
# the kernels read as "4-bit"), every slot starting at a multiple of 128 elements, and one
# FP32 buffer ``scales`` holds a run of scales per moment, as for 8 bits. A parameter whose
# last dimension is odd (a convolution's 3 x 3 kernel, a 1-D tensor of odd length) has no
# pairs of elements to share a byte in its rows: it keeps 8-bit moments, in an 8-bit bucket
# of the same group (the same rule on every mesh: the global shape decides). A 1-D DTensor
# parameter keeps FP32 moments and smaller parameters FP32 moments (Note [8-bit buckets]).
# The CPU and CUDA kernels step them (Note [4-bit CUDA step] in csrc/cuda/adamw_cuda.cu).


def takes_4bit(p: torch.Tensor) -> bool:
    """Whether a parameter large enough for low-bit moments can hold 4-bit codes (Note
    [4-bit buckets]): a last dimension of even length."""
    return p.dim() >= 1 and p.shape[-1] % 2 == 0


# Note [4-bit state entries]
# A moment stored in 4 bits is the pair `<moment>_codes4` (uint8, two codes per byte along
# the last dimension: shape (*p.shape[:-1], p.shape[-1] / 2), ops.codes_shape_4bit, the
# element of even index in the low nibble) and `<moment>_scales4` (FP32, one per block of
# 128 elements of each row: ops.scales_shape_4bit(p.shape)), in place of `<moment>`: what
# ops.quantize_4bit returns. The names are not the 8-bit pair's, so that which format a
# pair is in is read from its keys, never guessed from shapes, and torch's AdamW stops
# with KeyError 'exp_avg' instead of stepping from codes (ruda_torch.dequantize_state_dict
# converts). For a DTensor parameter both are DTensors with its mesh and placements: a
# shard of rows (Shard(0), FSDP2's and HSDP's) holds its rows' whole bytes and scales, so
# the pair is the same on every mesh and DCP reshards it like any tensor (Note [8-bit blocks
# on every mesh] has the placements that would cut a block, refused alike).
def check_4bit(entry, p: torch.Tensor, key: str, where: str) -> None:
    """The 4-bit pair of moment ``key`` for parameter ``p`` (Note [4-bit state entries]):
    raises ValueError naming the key, what was found and what is accepted."""
    ck, sk = codes4_key(key), scales4_key(key)
    codes, scales = entry[ck], entry[sk]
    for k, v in ((ck, codes), (sk, scales)):
        if not isinstance(v, torch.Tensor) or v.is_meta:
            raise ValueError(f"{where}[{k!r}] must be a tensor with values, got {found(v)}")
    if codes.dtype != torch.uint8:
        raise ValueError(f"{where}[{ck!r}] must be uint8 (4-bit codes, two per byte), got "
                         f"{codes.dtype}")  # fmt: skip
    if scales.dtype != torch.float32:
        raise ValueError(f"{where}[{sk!r}] must be float32 (block scales), got {scales.dtype}")
    if not takes_4bit(p):
        raise ValueError(
            f"{where} holds 4-bit moments ({ck!r}), but its parameter of shape "
            f"{tuple(p.shape)} has an odd last dimension, whose elements 4-bit codes cannot "
            "pair: convert the entry with ruda_torch.dequantize_state_dict"
        )
    want_codes, want_scales = ops.codes_shape_4bit(p.shape), ops.scales_shape_4bit(p.shape)
    for k, v, want in ((ck, codes, want_codes), (sk, scales, want_scales)):
        if tuple(v.shape) != want:
            raise ValueError(
                f"{where}[{k!r}] has shape {tuple(v.shape)}; for a parameter of shape "
                f"{tuple(p.shape)} it has shape {want} (ruda_torch.ops.quantize_4bit's; Note "
                "[4-bit state entries] in ruda_torch/_state4bit.py)"
            )
    mesh = getattr(p, "device_mesh", None)
    for k, v in ((ck, codes), (sk, scales)):
        v_mesh = getattr(v, "device_mesh", None)
        if v_mesh is None:
            continue
        if mesh is None or v_mesh != mesh or tuple(v.placements) != tuple(p.placements):
            raise ValueError(
                f"{where}[{k!r}] is a DTensor on mesh {v_mesh} with placements "
                f"{tuple(v.placements)}; the 4-bit pair of "
                + ("a plain parameter is plain tensors" if mesh is None else
                   f"a parameter on mesh {mesh} is placed {tuple(p.placements)} as it is")
            )  # fmt: skip
    if hasattr(codes, "device_mesh") != hasattr(scales, "device_mesh"):
        raise ValueError(f"{where}[{ck!r}] and [{sk!r}]: both DTensors or neither")
    lc, ls = local(codes), local(scales)
    if hasattr(codes, "device_mesh"):
        lshape = ops.shape_of_codes_4bit(lc.shape)
        if tuple(ls.shape) != ops.scales_shape_4bit(lshape):
            raise ValueError(
                f"{where}[{sk!r}] has local shape {tuple(ls.shape)}; the scales of local codes "
                f"of shape {tuple(lc.shape)} have shape {ops.scales_shape_4bit(lshape)}"
            )


def decoded_4bit(codes: torch.Tensor, scales: torch.Tensor, key: str) -> torch.Tensor:
    """The FP32 values of 4-bit moment ``key``'s pair, decoded shard by shard: a DTensor
    with the codes' placements for DTensor codes."""
    code = "signed" if key == "exp_avg" else "unsigned"
    values = ops.dequantize_4bit(local(codes), local(scales), code)
    if not hasattr(codes, "device_mesh"):
        return values
    from torch.distributed.tensor import DTensor

    shape = ops.shape_of_codes_4bit(codes.shape)
    return DTensor.from_local(values, codes.device_mesh, codes.placements, run_check=False,
                              shape=shape, stride=values.new_empty(shape, device="meta").stride())  # fmt: skip


class FourBit:
    """What a bucket of 4-bit moments asks its format (Note [4-bit buckets])."""

    name = "4bit"
    block = BLOCK_4BIT
    state_dtype = torch.int8  # the kernels' marker of 4-bit buffers (two codes per byte)
    per_byte = 2

    codes_key = staticmethod(codes4_key)
    scales_key = staticmethod(scales4_key)
    ragged_row = staticmethod(ops.ragged_row_4bit)
    scales_shape = staticmethod(ops.scales_shape_4bit)
    codes_shape = staticmethod(ops.codes_shape_4bit)
    check = staticmethod(check_4bit)

    @staticmethod
    def quantize(x: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.quantize_4bit(x, "signed" if key == "exp_avg" else "unsigned")

    @staticmethod
    def decoded(codes: torch.Tensor, scales: torch.Tensor, key: str) -> torch.Tensor:
        return decoded_4bit(codes, scales, key)

    @staticmethod
    def same_blocks(codes: torch.Tensor, scales: torch.Tensor) -> bool:
        """Whether an accepted pair's local tensors copy into a slot as they are (always:
        4-bit pairs have one format)."""
        return True


FORMAT = FourBit()
