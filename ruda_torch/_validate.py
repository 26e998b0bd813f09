"""Argument checks shared by the optimizer and the functional API, with torch's messages."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from ._common import (
    CODED_KEYS,
    MASTER_KEY,
    REMAINDER_KEY,
    REQUIRED_KEYS,
    STATE_KEYS,
    check_shape,
    found,
)
from ._state4bit import check_4bit
from ._state8bit import check_8bit, moment_format


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
    if not eight_bit and ({"8bit", "4bit"} & set(formats.values())):
        raise ValueError(
            f"{where} holds {'8-bit' if '8bit' in formats.values() else '4-bit'} moments "
            f"({sorted(k for k in entry if k in CODED_KEYS)}), "
            "which only the fused path reads: use fused_step=True for its group, or convert "
            "the state dict with ruda_torch.dequantize_state_dict first"
        )
    return formats


def _check_values(value, p: torch.Tensor, key: str, where: str) -> None:
    if (
        not isinstance(value, torch.Tensor)
        or not (value.is_floating_point() or value.is_complex())
        or value.is_meta
    ):
        raise ValueError(
            f"{where}[{key!r}] must be a floating tensor with values, got {found(value)}"
        )
    check_shape(value, p, key, where)
    if value.is_complex() != p.is_complex():
        raise ValueError(f"{where}[{key!r}] is {value.dtype} for a {p.dtype} parameter")


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
        elif form == "4bit":
            check_4bit(entry, p, key, where)
    if MASTER_KEY in entry:
        _check_values(entry[MASTER_KEY], p, MASTER_KEY, where)
    if REMAINDER_KEY in entry:
        check_remainder(entry, p, where)
    return step_value(entry["step"], where)


def check_remainder(entry, p: torch.Tensor, where: str) -> None:
    """A remainder master (Note [Remainder master] in csrc/adamw_math.h): int16, shaped
    like a bfloat16 ``p``, and not beside an FP32 master (one master, in one form)."""
    value = entry[REMAINDER_KEY]
    if MASTER_KEY in entry:
        raise ValueError(
            f"{where} holds both {MASTER_KEY!r} and {REMAINDER_KEY!r}: a parameter has one "
            "master, in one form; remove one of them"
        )
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int16 or value.is_meta:
        raise ValueError(
            f"{where}[{REMAINDER_KEY!r}] must be an int16 tensor with values (the low 16 bits "
            f"of the FP32 master), got {found(value)}"
        )
    if p.dtype != torch.bfloat16:
        raise ValueError(
            f"{where}[{REMAINDER_KEY!r}] is the remainder of the master of a bfloat16 "
            f"parameter, but the parameter is {p.dtype}"
        )
    check_shape(value, p, REMAINDER_KEY, where)


def check_flat_param(p: torch.Tensor, where: str) -> None:
    """flat_grads=True makes ``p.grad`` a view of the bucket's buffer: for plain tensors
    and nn.Parameters, whose gradients autograd accumulates in place."""
    if getattr(p, "_is_flat_param", False):
        raise ValueError(
            f"flat_grads=True: {where} is an FSDP FlatParameter, whose gradient FSDP "
            "replaces after every reduce-scatter; it is already one flat gradient per FSDP "
            "unit, so flat_grads adds nothing: pass flat_grads=False (docs/usage.md)"
        )
    if hasattr(p, "device_mesh"):
        raise ValueError(
            f"flat_grads=True: {where} is a DTensor (FSDP2 / tensor parallel), whose gradient "
            "FSDP2 writes as a new sharded tensor at every backward; pass flat_grads=False "
            "(docs/usage.md)"
        )
    if type(p) not in (torch.Tensor, torch.nn.Parameter):
        raise ValueError(
            f"flat_grads=True takes torch.Tensor and nn.Parameter parameters; {where} is a "
            f"{type(p).__name__}. Use flat_grads=False for its group"
        )
    check_flat_grad_dtype(p, where)


def check_flat_grad_dtype(p: torch.Tensor, where: str) -> None:
    """A flat view holds a gradient in the parameter's dtype: a ``grad_dtype`` of its own
    (torch 2.13+) would refuse it. Checked at construction and, since torch lets a
    parameter whose gradient was cleared take another grad_dtype, before a step or
    zero_grad() puts a view back (Bucket.replaced_grads), before anything is written."""
    grad_dtype = getattr(p, "grad_dtype", p.dtype)
    if grad_dtype is not None and grad_dtype != p.dtype:
        raise ValueError(
            f"flat_grads=True: {where} ({p.dtype}) has grad_dtype={grad_dtype}, but the flat "
            "gradient buffer holds gradients in the parameters' dtype: pass flat_grads=False "
            "for its group (or set its grad_dtype to None or its dtype)"
        )


def check_no_duplicates(params: list, gi: int) -> None:
    """A step would update a listed-twice parameter twice: refused when the step's plan
    is made (torch.optim warns at construction, see AdamW.add_param_group)."""
    seen: dict[int, int] = {}
    for j, p in enumerate(params):
        first = seen.setdefault(id(p), j)
        if first != j:
            raise ValueError(
                f"param group {gi} lists the same parameter twice (positions {first} and {j}); "
                "fused_step=True steps each parameter once per step: remove the duplicate"
            )


def check_stats_dtype(dtype: torch.dtype, gi: int, j: int | None = None) -> None:
    """The statistics read FP32 and 16-bit gradients (``j``: the parameter, where known)."""
    if dtype == torch.float64:
        what = "has float64 parameters" if j is None else f"parameter {j} is float64"
        raise ValueError(
            f"hierarchical_stats=True reads FP32, FP16 and BF16 gradients; param group {gi} "
            f"{what} (FP64 gradients). Use max_grad_norm without hierarchical_stats for FP64 "
            "models"
        )
