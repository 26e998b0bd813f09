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


def check_required_keys(entry, where: str) -> None:
    missing = [k for k in REQUIRED_KEYS if k not in entry]
    if missing:
        raise ValueError(
            f"{where} has keys {sorted(map(str, entry))} but lacks {missing}; an AdamW state "
            "entry holds 'step', 'exp_avg', 'exp_avg_sq' (and 'max_exp_avg_sq' with amsgrad), "
            "or is empty ({}) to start the parameter afresh"
        )


def check_state_entry(entry, p: torch.Tensor, where: str) -> float:
    """A non-empty state entry in torch.optim.AdamW's layout for parameter ``p``: the
    required keys, moments that are real floating tensors shaped like ``p``, a valid step
    counter (returned). Raises ValueError naming ``where`` otherwise."""
    if not isinstance(entry, Mapping):
        raise ValueError(f"{where} must be a dict (torch.optim.AdamW's layout), got "
                         f"{type(entry).__name__}")  # fmt: skip
    check_required_keys(entry, where)
    for key in (*STATE_KEYS, MASTER_KEY):
        if key not in entry:
            continue
        value = entry[key]
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}[{key!r}] must be a tensor, got {type(value).__name__}")
        if not (value.is_floating_point() or value.is_complex()) or value.is_meta:
            raise ValueError(
                f"{where}[{key!r}] must be a floating tensor with values, got "
                f"{value.dtype}{' on meta' if value.is_meta else ''}"
            )
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"{where}[{key!r}] has shape {tuple(value.shape)} but its parameter has shape "
                f"{tuple(p.shape)}; a parameter's state must keep its shape (reset it with "
                "optimizer.state[p] = {} to start afresh)"
            )
        if value.is_complex() != p.is_complex():
            raise ValueError(f"{where}[{key!r}] is {value.dtype} for a {p.dtype} parameter")
    return step_value(entry["step"], where)
