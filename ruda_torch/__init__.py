"""ruda_torch: a native, in-place, device-side AdamW/AMSGrad step for PyTorch.

- ``ruda_torch.AdamW``: drop-in for ``torch.optim.AdamW`` (``fused_step=True`` for the
  native kernel, ``hierarchical_stats=True`` for the device-side gradient report);
  ``ruda_torch.Adam``: the same for ``torch.optim.Adam`` (L2 weight decay).
- ``ruda_torch.adamw_step`` with ``AdamWOptions``, ``StepControl``, ``AdamWState``:
  the out-of-place functional API.
- ``ruda_torch.StatsPlan``: the reduction plan of the gradient statistics.
- ``ruda_torch.ops``: the native operators; ``ruda_torch.reference``: the FP64 oracle
  (imported explicitly).
- ``ruda_torch.amp.GradScaler``: ``torch.amp.GradScaler`` whose ``step`` takes the
  non-finite check from the optimizer's statistics instead of a pass of its own.
- ``ruda_torch.dequantize_state_dict``: an optimizer checkpoint with 8-bit moments
  (``state_precision="8bit"``) in torch.optim.AdamW's format;
  ``ruda_torch.master_weights_of``: every parameter's FP32 master, kept whole
  (``master_weights=True``) or as a remainder (``master_weights="remainder"``);
  ``ruda_torch.match_checkpoint``: the template for ``torch.distributed.checkpoint.load``
  of a checkpoint whose moments are in another form (another ``state_precision``, the
  first 8-bit format).
- ``ruda_torch.compiled_backends()``: which kernels this build contains;
  ``ruda_torch.cpu_capability()``: the vector ISA of the CPU kernels in use.
"""

from . import amp, ops
from ._build import compiled_backends, cpu_capability
from ._checkpoint import match_checkpoint
from ._remainder import master_weights_of
from ._state8bit import dequantize_state_dict
from .functional import AdamWOptions, AdamWState, StepControl, StepResult, adamw_step
from .optimizer import Adam, AdamW, GradientReport
from .stats_plan import StatsPlan

__version__ = "0.1.0"

__all__ = [
    "Adam",
    "AdamW",
    "AdamWOptions",
    "AdamWState",
    "GradientReport",
    "StatsPlan",
    "StepControl",
    "StepResult",
    "adamw_step",
    "amp",
    "compiled_backends",
    "cpu_capability",
    "dequantize_state_dict",
    "master_weights_of",
    "match_checkpoint",
    "ops",
]
