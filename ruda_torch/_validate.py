"""Argument checks shared by the optimizer and the functional API, with torch's messages."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch


def check_hyperparameters(lr, betas, eps, weight_decay, read_values: bool = True) -> None:
    """torch.optim.AdamW's checks, with its messages. A Tensor lr (one element, as torch
    allows; read by the kernel from memory) has its value checked only where
    ``read_values``: at construction and ``add_param_group``, as torch does, and not at
    every step, where reading a CUDA value would be a host sync."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        if lr.dtype not in (torch.float32, torch.float64):
            raise ValueError(
                f"Tensor lr must be float32 or float64, got {lr.dtype}: the kernels read an FP32 "
                "or FP64 value (a 16-bit lr would be rounded to 8 or 11 bits of mantissa); "
                "pass lr.float() or a Python float"
            )
        if lr.is_meta:
            raise ValueError(
                "Tensor lr is on the meta device and holds no value: give it a value on the "
                "CPU or the parameters' device (or pass a Python float)"
            )
        if read_values:
            value = float(lr.detach().reshape(()).cpu())
            if not 0.0 <= value or not math.isfinite(value):
                raise ValueError(f"Invalid learning rate: {lr}")
    elif not 0.0 <= lr or not math.isfinite(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps or not math.isfinite(eps):
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")  # torch's text
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):
            raise ValueError(f"beta parameter at index {i} must be a float, not a Tensor")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if not 0.0 <= weight_decay or not math.isfinite(weight_decay):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")


def check_max_grad_norm(value):
    """``None``, or a positive finite real number (returned as a float)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(
            f"Invalid max_grad_norm: {value!r} of type {type(value).__name__}; it must be a "
            "positive finite number (a float) or None"
        )
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"Invalid max_grad_norm: {value!r}; it must be positive and finite")
    return float(value)


def check_process_group(group, name: str = "process_group") -> None:
    """``None`` or a registered ``torch.distributed.ProcessGroup``."""
    if group is None:
        return
    import torch.distributed as dist

    if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
        raise TypeError(
            f"{name} must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}"
        )
    from .distributed import ranks_of

    ranks_of(group, name)  # registered, and torch.distributed still initialized


# Note [Step counter range] in csrc/adamw_math.h: what the kernels do with counters that
# only the device can see; everything that enters from the host is checked here.
def step_value(value, where: str) -> float:
    """A step counter from a checkpoint or a caller, as a float: a non-negative integral
    finite number (Python or NumPy scalar, or a one-element real tensor)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{where}['step'] must hold one value, got shape {tuple(value.shape)}")
        if value.is_meta:
            raise ValueError(f"{where}['step'] is a meta tensor; it must hold a value")
        if value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{where}['step'] must be a real number, got {value.dtype}")
        number = value.detach().reshape(()).to("cpu", torch.float64).item()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    else:
        raise ValueError(
            f"{where}['step'] must be a number or a one-element tensor, got {type(value).__name__}"
        )
    if not (math.isfinite(number) and number >= 0 and number == int(number)):
        raise ValueError(
            f"{where}['step'] is {number!r}; a step counter must be a non-negative integer "
            "(the number of updates applied)"
        )
    return number


STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# The FP32 master copy of a 16-bit parameter (master_weights; Note [Master weights] in
# ruda_torch/_fused.py). torch.optim.AdamW carries it along as an unknown key.
MASTER_KEY = "master_param"
REQUIRED_KEYS = ("step", "exp_avg", "exp_avg_sq")

# Note [8-bit state entries]
# A moment stored in 8 bits (state_precision="8bit", Note [8-bit moments] in
# csrc/quant8.h) is not a tensor of values: it is a pair, `<moment>_codes` (uint8, shaped
# like the parameter, laid out in memory as the kernel steps it) and `<moment>_scales`
# (FP32, one per block of 256 codes in the codes' memory order), in place of `<moment>`.
# The names differ from torch's on purpose: torch.optim.AdamW casts every state tensor
# it loads to the parameter's dtype, so codes under torch's name would load there as
# values 0..255 and step silently wrong; under their own names torch's step stops with
# KeyError 'exp_avg' instead, and ruda_torch.dequantize_state_dict converts.
BLOCK_8BIT = 256


def codes_key(key: str) -> str:
    return key + "_codes"


def scales_key(key: str) -> str:
    return key + "_scales"


def pair_keys(moments) -> tuple[str, ...]:
    """The keys of the 8-bit pairs of ``moments``, in order."""
    return tuple(k for key in moments for k in (codes_key(key), scales_key(key)))


EIGHT_BIT_KEYS = pair_keys(STATE_KEYS)


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


def check_required_keys(entry, where: str, eight_bit: bool = True) -> dict:
    """'step', and 'exp_avg' and 'exp_avg_sq' in either form (Note [8-bit state entries];
    the 8-bit form only where ``eight_bit``: the fused path). Returns each moment's
    moment_format()."""
    formats = {key: moment_format(entry, key, where) for key in STATE_KEYS}
    missing = ["step"] if "step" not in entry else []
    missing += [k for k in REQUIRED_KEYS[1:] if formats[k] is None]
    if missing:
        raise ValueError(
            f"{where} has keys {sorted(map(str, entry))} but lacks {missing}; an AdamW state "
            "entry holds 'step', 'exp_avg', 'exp_avg_sq' (and 'max_exp_avg_sq' with amsgrad), "
            "or is empty ({}) to start the parameter afresh"
        )
    if not eight_bit and "8bit" in formats.values():
        raise ValueError(
            f"{where} holds 8-bit moments ({sorted(k for k in entry if k in EIGHT_BIT_KEYS)}), "
            "which only the fused path reads: use fused_step=True for its group, or convert "
            "the state dict with ruda_torch.dequantize_state_dict first"
        )
    return formats


def _check_values(value, p: torch.Tensor, key: str, where: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{where}[{key!r}] must be a tensor, got {type(value).__name__}")
    if not (value.is_floating_point() or value.is_complex()) or value.is_meta:
        raise ValueError(
            f"{where}[{key!r}] must be a floating tensor with values, got "
            f"{value.dtype}{' on meta' if value.is_meta else ''}"
        )
    _check_shape(value, p, key, where)
    if value.is_complex() != p.is_complex():
        raise ValueError(f"{where}[{key!r}] is {value.dtype} for a {p.dtype} parameter")


def _check_shape(value: torch.Tensor, p: torch.Tensor, key: str, where: str) -> None:
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(
            f"{where}[{key!r}] has shape {tuple(value.shape)} but its parameter has shape "
            f"{tuple(p.shape)}; a parameter's state must keep its shape (reset it with "
            "optimizer.state[p] = {} to start afresh)"
        )


def check_8bit(entry, p: torch.Tensor, key: str, where: str) -> None:
    """The pair of Note [8-bit state entries]: uint8 codes shaped like ``p`` whose local
    tensor is dense (its memory order defines the blocks), and FP32 scales with one value
    per block of the local codes (at least one: a DTensor's local scales are padded to
    the largest shard's blocks, Note [8-bit DTensor state] in ruda_torch/_fused.py)."""
    from ._generic import local

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
    _check_shape(codes, p, ck, where)
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


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free range of memory without overlap
    (at::Tensor::is_non_overlapping_and_dense, which Python does not expose): contiguous,
    or a permutation of a contiguous layout (Note [Dense layouts] in csrc/bindings.cpp)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted(
        (st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def check_state_entry(entry, p: torch.Tensor, where: str, eight_bit: bool = True) -> float:
    """A non-empty state entry for parameter ``p`` in torch.optim.AdamW's layout, each
    moment possibly in its 8-bit form (Note [8-bit state entries], where ``eight_bit``):
    the required keys, moments that are real floating tensors shaped like ``p`` (or valid
    8-bit pairs), a valid step counter (returned). Raises ValueError naming ``where``
    otherwise."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a dict (torch.optim.AdamW's layout), got "
                         f"{type(entry).__name__}")  # fmt: skip
    for key, form in check_required_keys(entry, where, eight_bit).items():
        if form == "plain":
            _check_values(entry[key], p, key, where)
        elif form == "8bit":
            check_8bit(entry, p, key, where)
    if MASTER_KEY in entry:
        _check_values(entry[MASTER_KEY], p, MASTER_KEY, where)
    return step_value(entry["step"], where)
