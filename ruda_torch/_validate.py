"""Argument checks shared by the optimizer and the functional API, with torch's messages."""

from __future__ import annotations

import math

import torch


def check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor):
        raise ValueError(
            "ruda_torch does not take lr as a Tensor (the kernel reads it as a float "
            "argument); pass a Python float"
        )
    if not 0.0 <= lr or not math.isfinite(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps or not math.isfinite(eps):
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair of floats, got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor):
            raise ValueError(f"beta parameter at index {i} must be a float, not a Tensor")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {beta}")
    if not 0.0 <= weight_decay or not math.isfinite(weight_decay):
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
