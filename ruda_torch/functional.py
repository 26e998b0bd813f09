"""Low-level, out-of-place AdamW step (docs/design.md section 5).

``adamw_step`` runs the same native kernel as ``ruda_torch.AdamW(fused_step=True)`` on
one FP32 master tensor, but writes into freshly allocated outputs: three FP32 tensors
(parameters and both moments; four with AMSGrad) plus the step counter. Inputs are never
written and never aliased by the outputs, and a call that fails validation leaves every
input unchanged. A returned result means the work was submitted: on CUDA, synchronize
(``torch.cuda.synchronize()``) before checkpointing the outputs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import ops
from ._build import check_device
from ._validate import check_hyperparameters, step_value

_GRAD_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AdamWOptions:
    """Hyperparameters of one update; the defaults are ruda_torch's (not torch's). ``lr``
    may be a one-element tensor (on the CPU or the master's device), read from memory by
    the kernel."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-5
    weight_decay: float = 1e-4
    amsgrad: bool = False
    maximize: bool = False

    def __post_init__(self):
        check_hyperparameters(self.lr, self.betas, self.eps, self.weight_decay)


@dataclass(frozen=True)
class StepControl:
    """Per-step control. ``gradient_scale`` divides the stored gradient (a positive
    finite number, or a 1-element tensor on the master's device such as GradScaler's
    scale; a tensor holding 0, a negative, an infinite or a NaN scale skips the step);
    ``skip_update`` (a bool, an int or a NumPy bool, by truth value, or a 1-element
    tensor such as GradScaler's ``found_inf``, nonzero = skip) leaves everything
    unchanged. Tensors are read by the kernel: no host sync."""

    gradient_scale: float | torch.Tensor = 1.0
    skip_update: bool | torch.Tensor = False

    def __post_init__(self):
        skip = self.skip_update
        if isinstance(skip, torch.Tensor):
            return
        numpy_bool = type(skip).__module__ == "numpy" and type(skip).__name__ in ("bool", "bool_")
        if not (isinstance(skip, numbers.Integral) or numpy_bool):
            raise TypeError(
                f"StepControl.skip_update must be a bool, an int or a one-element tensor, got "
                f"{type(skip).__name__}"
            )
        object.__setattr__(self, "skip_update", bool(skip))


@dataclass(frozen=True)
class AdamWState:
    """Optimizer state of one master tensor: ``step`` (0-dim FP32 tensor on the
    master's device, the number of applied updates), ``exp_avg``, ``exp_avg_sq`` and,
    with AMSGrad, ``max_exp_avg_sq`` (FP32, shaped like the master)."""

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None = None

    def to_parts(self):
        """``(step, exp_avg, exp_avg_sq, max_exp_avg_sq)`` for explicit checkpointing."""
        return self.step, self.exp_avg, self.exp_avg_sq, self.max_exp_avg_sq

    @classmethod
    def from_parts(cls, step, exp_avg, exp_avg_sq, max_exp_avg_sq=None) -> AdamWState:
        """Rebuild a state from ``to_parts()``; ``step`` (an int or a one-element tensor)
        must be a non-negative integer count (its value is read: a host sync on CUDA)."""
        device = exp_avg.device
        # Where a counter enters from a checkpoint (Note [Step counter range]).
        value = step_value(step, "AdamWState.from_parts: state")
        step = torch.tensor(value, dtype=torch.float32, device=device)
        state = cls(step, exp_avg, exp_avg_sq, max_exp_avg_sq)
        for name in ("exp_avg_sq", "max_exp_avg_sq"):
            t = getattr(state, name)
            if t is not None and (t.shape != exp_avg.shape or t.device != device):
                raise ValueError(
                    f"{name} must match exp_avg's shape {tuple(exp_avg.shape)} and device "
                    f"{device}, got {tuple(t.shape)} on {t.device}"
                )
        return state


class StepResult(NamedTuple):
    """``parameters`` and ``state`` are new tensors. ``updated`` is a bool when neither
    ``skip_update`` nor ``gradient_scale`` was a tensor, and a 0-dim bool tensor on the
    device (no host sync) otherwise. Do not advance a data cursor only because of it."""

    parameters: torch.Tensor
    state: AdamWState
    updated: bool | torch.Tensor


def _control_tensor(value, name: str, device: torch.device) -> torch.Tensor:
    if value.numel() != 1:
        raise ValueError(f"StepControl.{name} must hold one value, got shape {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"StepControl.{name} must be on {device}, got {value.device}")
    return value.detach().to(torch.float32).reshape(1)


def adamw_step(
    master: torch.Tensor,
    gradient: torch.Tensor,
    state: AdamWState | None,
    options: AdamWOptions | None = None,
    control: StepControl | None = None,
) -> StepResult:
    """One AdamW/AMSGrad update of ``master`` (dense FP32) with ``gradient`` (same shape,
    FP32/FP16/BF16), out of place. ``state=None`` starts from zero moments and step 0.
    See docs/semantics.md for the exact formula."""
    options = AdamWOptions() if options is None else options
    control = StepControl() if control is None else control
    if not isinstance(master, torch.Tensor) or master.dtype != torch.float32:
        raise ValueError(f"master must be a float32 tensor, got {getattr(master, 'dtype', master)}")
    if master.layout != torch.strided:
        raise ValueError("master must be a dense (strided) tensor")
    device = master.device
    check_device(device, "ruda_torch.adamw_step")
    if not isinstance(gradient, torch.Tensor) or gradient.dtype not in _GRAD_DTYPES:
        raise ValueError(
            f"gradient must be a float32, float16 or bfloat16 tensor, got "
            f"{getattr(gradient, 'dtype', type(gradient).__name__)}"
        )
    if gradient.layout != torch.strided:
        raise ValueError("gradient must be dense; sparse gradients are not supported")
    if gradient.shape != master.shape or gradient.device != device:
        raise ValueError(
            f"gradient must match master (shape {tuple(master.shape)} on {device}), got "
            f"{tuple(gradient.shape)} on {gradient.device}"
        )
    if state is not None:
        for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            t = getattr(state, name)
            if t is None:
                if name == "max_exp_avg_sq" and options.amsgrad:
                    raise ValueError("options.amsgrad is set but state.max_exp_avg_sq is None")
                continue
            if t.dtype != torch.float32 or t.shape != master.shape or t.device != device:
                raise ValueError(
                    f"state.{name} must be float32 with master's shape {tuple(master.shape)} "
                    f"on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                )
        if state.step.numel() != 1 or state.step.device != device:
            raise ValueError(f"state.step must be one value on {device}")
    grad_scale = None
    if isinstance(control.gradient_scale, torch.Tensor):
        grad_scale = _control_tensor(control.gradient_scale, "gradient_scale", device)
    elif control.gradient_scale != 1.0:
        scale = float(control.gradient_scale)
        if not (scale > 0.0 and scale != float("inf")):
            raise ValueError(f"StepControl.gradient_scale must be positive, got {scale}")
        grad_scale = torch.full((1,), scale, dtype=torch.float32, device=device)
    found_inf = None
    if isinstance(control.skip_update, torch.Tensor):
        found_inf = _control_tensor(control.skip_update, "skip_update", device)

    # Validation is done: from here on only new tensors are written.
    with torch.no_grad():
        params = master.detach().clone(memory_format=torch.contiguous_format)
        if state is None:
            exp_avg = torch.zeros_like(params)
            exp_avg_sq = torch.zeros_like(params)
            max_sq = torch.zeros_like(params) if options.amsgrad else None
            steps = torch.zeros(1, dtype=torch.float32, device=device)
        else:
            exp_avg = state.exp_avg.detach().clone(memory_format=torch.contiguous_format)
            exp_avg_sq = state.exp_avg_sq.detach().clone(memory_format=torch.contiguous_format)
            max_sq = None
            if options.amsgrad:
                max_sq = state.max_exp_avg_sq.detach().clone(memory_format=torch.contiguous_format)
            steps = state.step.detach().to(torch.float32).reshape(1).clone()
        new_state = AdamWState(steps[0], exp_avg.view_as(params), exp_avg_sq.view_as(params),
                               None if max_sq is None else max_sq.view_as(params))  # fmt: skip
        if control.skip_update is True:
            return StepResult(params, new_state, False)
        lr = options.lr  # a Tensor lr is read from memory (on the CPU: at the call)
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and lr.device != device:
            lr = lr.to(device, non_blocking=device.type == "cuda")
        ops.adamw_scaled_(
            [params.view(-1)],
            [gradient.detach().contiguous().view(-1)],
            exp_avg.view(-1),
            exp_avg_sq.view(-1),
            None if max_sq is None else max_sq.view(-1),
            steps,
            torch.zeros((1, 2), dtype=torch.int64),
            lr=lr,
            beta1=options.betas[0],
            beta2=options.betas[1],
            eps=options.eps,
            weight_decay=options.weight_decay,
            maximize=options.maximize,
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
    updated = True if found_inf is None else found_inf[0] == 0
    if grad_scale is not None and isinstance(control.gradient_scale, torch.Tensor):
        scale = grad_scale[0]  # the kernel's rule (decide_step in csrc/adamw_math.h)
        usable = (scale > 0) & torch.isfinite(scale)
        updated = usable if updated is True else updated & usable
    return StepResult(params, new_state, updated)
