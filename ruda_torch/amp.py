"""``ruda_torch.amp.GradScaler``: ``torch.amp.GradScaler`` without its extra gradient pass.

Note [One gradient pass under GradScaler]
``torch.amp.GradScaler.step(opt)``, for an optimizer that unscales inside its step
(``_step_supports_amp_scaling``, ruda_torch's and torch's fused AdamW), first runs
``_check_inf_per_device``: an in-place multiply of every gradient by 1.0 that reads and
writes all of them to find non-finite values, about as long as the step itself. With
``hierarchical_stats=True`` ruda_torch.AdamW counts the non-finite values of the
unscaled gradients in its own statistics pass, and skips the step on the device when
there is one. This scaler hands the step the scale only, and then gives ``update()`` the
statistics' verdict as ``found_inf`` (a device tensor: no host sync), so the scale
schedule is the one torch's scaler computes from its own pass: the same skipped steps,
the same backoff and growth. For any other optimizer, after ``unscale_`` (the gradients
are then already unscaled and checked), and with the scaler disabled, it is exactly
``torch.amp.GradScaler``.
"""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from . import _C
from .optimizer import AdamW

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """A drop-in for ``torch.amp.GradScaler`` (same constructor and methods); see
    Note [One gradient pass under GradScaler]."""

    def step(self, optimizer, *args, **kwargs):
        if not (self._enabled and isinstance(optimizer, AdamW) and optimizer.hierarchical_stats):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs or args:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is OptState.UNSCALED:  # unscale_ ran its pass already
            return super().step(optimizer, *args, **kwargs)
        if not any(g.get("params") and _C.grads_of(list(g["params"]))[1] < len(g["params"])
                   for g in optimizer.param_groups):  # fmt: skip
            # torch.amp.GradScaler's own check (its pass found no gradient to inspect): a
            # step without gradients must not count as a finite one and grow the scale.
            raise AssertionError("No inf checks were recorded for this optimizer.")
        optimizer.grad_scale = self._get_scale_async() * getattr(optimizer, "grad_scale", 1)
        optimizer.found_inf = None
        try:
            retval = optimizer.step(**kwargs)
        finally:
            del optimizer.grad_scale
            del optimizer.found_inf
        report = optimizer.last_report
        found = (report.tensor[2:3] != 0).to(torch.float32)  # the non-finite count
        state["found_inf_per_device"] = {found.device: found}
        state["stage"] = OptState.STEPPED
        return retval
