"""``GradientReport``: the gradient statistics of one step, as device tensors."""

from __future__ import annotations

import torch

__all__ = ["GradientReport"]


class GradientReport:
    """The gradient statistics of one step, as device tensors (Note [Statistics row]).

    ``tensor`` holds ``[sum_of_squares, max_abs, nonfinite_count]`` of the unscaled
    gradients of every active parameter. The other attributes are 0-dim tensors computed
    on the device when first read; nothing here forces a host sync until you call
    ``.item()`` (or print) on one of them.
    """

    def __init__(self, tensor: torch.Tensor, max_grad_norm, found_inf):
        self.tensor = tensor
        self._max_grad_norm = max_grad_norm
        self._found_inf = found_inf

    @property
    def grad_norm(self) -> torch.Tensor:
        return self.tensor[0].sqrt()

    @property
    def max_abs(self) -> torch.Tensor:
        return self.tensor[1]

    @property
    def nonfinite_count(self) -> torch.Tensor:
        return self.tensor[2]

    @property
    def clip_coef(self) -> torch.Tensor:
        """``min(1, max_grad_norm / (norm + 1e-6))``, or 1 without ``max_grad_norm``."""
        if self._max_grad_norm is None:
            return torch.ones((), dtype=torch.float32, device=self.tensor.device)
        norm = self.grad_norm
        # A true division, as in the kernel (a Python scalar over a tensor would multiply by
        # a reciprocal instead).
        return (torch.full_like(norm, self._max_grad_norm) / (norm + 1e-6)).clamp(max=1.0)

    @property
    def skipped(self) -> torch.Tensor:
        """True when the step was skipped (non-finite gradient or GradScaler's found_inf)."""
        skipped = self.tensor[2] != 0
        if self._found_inf is not None:
            skipped = skipped | (self._found_inf.reshape(()) != 0)
        return skipped

    def __repr__(self) -> str:
        return f"GradientReport(tensor={self.tensor})"
