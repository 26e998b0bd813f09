"""FP64 reference of the ruda_torch update (docs/design.md section 1): the oracle for tests.

This module is the explicitly invoked reference that tests, fixtures and benchmarks
compare the native kernels against. It is deliberately slow and simple: every input is
copied to a CPU FP64 tensor and the formula is evaluated term by term, exactly as
docs/design.md section 1 writes it. The optimizer never calls it, and it imports nothing
but torch, so it runs before (and without) the native extension being built.

For one-based step ``t = step + 1`` and every element::

    g      = stored_gradient * (clip_coef / gradient_scale)   # negated if maximize
    m      = beta1 * m_old + (1 - beta1) * g
    v      = beta2 * v_old + (1 - beta2) * g * g
    v_used = max(v_max_old, v)          # AMSGrad only; the UNcorrected max is stored
    p_new  = p * (1 - lr * weight_decay)
             - lr * (m / (1 - beta1^t)) / (sqrt(v_used / (1 - beta2^t)) + eps)

``1 - beta^t`` is computed by integer exponentiation (repeated squaring) in FP64, the
same algorithm the kernels use before casting it to FP32; here it stays FP64.

Because the reference is FP64, its own rounding error (about 1e-16 relative) is far
below FP32 resolution: the error of an FP32 implementation against it is, for test
purposes, that implementation's true error (see tests/tolerances.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = [
    "adamw_reference",
    "bias_correction",
    "dequantize_8bit_reference",
    "global_norm_reference",
    "quantize_8bit_reference",
]


def _integer_power(base: float, exponent: int) -> float:
    """``base ** exponent`` by repeated squaring in FP64 (Python floats are FP64)."""
    result = 1.0
    while exponent > 0:
        if exponent & 1:
            result *= base
        base *= base
        exponent >>= 1
    return result


def bias_correction(beta: float, t: int) -> float:
    """``1 - beta**t`` in FP64, with ``beta**t`` computed by repeated squaring.

    Args:
        beta: the moment coefficient (``beta1`` or ``beta2``).
        t: the one-based step count, a non-negative integer (``t = 0`` gives 0).
    """
    if isinstance(t, bool) or not isinstance(t, int):
        raise TypeError(f"t must be an int (got {type(t).__name__})")
    if t < 0:
        raise ValueError(f"t must be non-negative (got {t})")
    return 1.0 - _integer_power(float(beta), t)


def _to_float64(name: str, tensor: Tensor) -> Tensor:
    # Every float dtype converts exactly to FP64 (FP16, BF16 and FP32 are subsets), so
    # the reference sees the stored values themselves, not a rounded copy.
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(tensor).__name__})")
    if not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (got {tensor.dtype})")
    return tensor.detach().to(device="cpu", dtype=torch.float64, copy=True)


def _state_or_zeros(name: str, tensor: Tensor | None, like: Tensor) -> Tensor:
    if tensor is None:
        return torch.zeros_like(like)
    state = _to_float64(name, tensor)
    if state.shape != like.shape:
        raise ValueError(
            f"{name} must have the same shape as param (got {list(state.shape)} vs "
            f"{list(like.shape)})"
        )
    return state


def _old_step(step: int | Tensor) -> int:
    if isinstance(step, Tensor):
        if step.numel() != 1:
            raise ValueError(f"step must be a 0-dim tensor (got shape {list(step.shape)})")
        value = step.item()
    elif isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int or a 0-dim tensor (got {type(step).__name__})")
    else:
        value = step
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"step must hold an integer count (got {value})")
    value = int(value)
    if value < 0:
        raise ValueError(f"step must be non-negative (got {value})")
    return value


def _check_hyperparameters(
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    gradient_scale: float,
    clip_coef: float,
) -> None:
    if not 0.0 <= lr:
        raise ValueError(f"Invalid learning rate: {lr}")
    if len(betas) != 2:
        raise ValueError(f"betas must have two entries (got {len(betas)})")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")
    if not (math.isfinite(gradient_scale) and gradient_scale > 0.0):
        raise ValueError(f"gradient_scale must be finite and positive (got {gradient_scale})")
    if not math.isfinite(clip_coef):
        raise ValueError(f"clip_coef must be finite (got {clip_coef})")


def adamw_reference(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor | None,
    exp_avg_sq: Tensor | None,
    max_exp_avg_sq: Tensor | None,
    step: int | Tensor,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    amsgrad: bool = False,
    maximize: bool = False,
    gradient_scale: float = 1.0,
    clip_coef: float = 1.0,
    decoupled: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor]:
    """One AdamW / AMSGrad step of docs/design.md section 1 in FP64, out of place.

    Args:
        param: parameter values, any float dtype and shape.
        grad: the STORED gradient (before unscaling), any float dtype, same shape as
            ``param``; converted exactly to FP64.
        exp_avg: first moment ``m`` before the step, or None for a fresh state (zeros).
        exp_avg_sq: second moment ``v`` before the step, or None for zeros.
        max_exp_avg_sq: AMSGrad's running maximum of ``v`` before the step, or None for
            zeros. Ignored without ``amsgrad``.
        step: the number of steps taken so far (the OLD count, a non-negative integer or
            a 0-dim tensor holding one); the update uses ``t = step + 1``.
        lr: learning rate.
        betas: ``(beta1, beta2)``, each in [0, 1).
        eps: added to the bias-corrected square root, outside it.
        weight_decay: decoupled weight decay; never touches the gradient or moments.
        amsgrad: use ``max(v_max_old, v)`` in the denominator (default False).
        maximize: negate the gradient (default False).
        gradient_scale: the stored gradient is divided by this (default 1.0), finite
            and positive.
        clip_coef: the unscaled gradient is multiplied by this (default 1.0).
        decoupled: True (AdamW) decays the parameter by ``1 - lr * weight_decay``; False
            (Adam, L2) adds ``weight_decay * param`` to the unscaled, clipped (negated if
            maximize) gradient before the moments and does not decay the parameter.

    Returns:
        ``(param, exp_avg, exp_avg_sq, max_exp_avg_sq, step)``: new FP64 CPU tensors
        shaped like ``param`` (``max_exp_avg_sq`` is None without ``amsgrad``), and the
        new step count ``t`` as a 0-dim FP64 tensor. The inputs are not modified.
    """
    _check_hyperparameters(lr, betas, eps, weight_decay, gradient_scale, clip_coef)
    p = _to_float64("param", param)
    g = _to_float64("grad", grad)
    if g.shape != p.shape:
        raise ValueError(
            f"grad must have the same shape as param (got {list(g.shape)} vs {list(p.shape)})"
        )
    m = _state_or_zeros("exp_avg", exp_avg, p)
    v = _state_or_zeros("exp_avg_sq", exp_avg_sq, p)
    v_max = _state_or_zeros("max_exp_avg_sq", max_exp_avg_sq, p) if amsgrad else None
    t = _old_step(step) + 1
    beta1, beta2 = (float(beta) for beta in betas)

    g = g * (clip_coef / gradient_scale)
    if maximize:
        g = -g
    if not decoupled and weight_decay != 0:
        g = g + weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    v_used = v
    if v_max is not None:
        v_max = torch.maximum(v_max, v)
        v_used = v_max
    bc1 = bias_correction(beta1, t)
    bc2 = bias_correction(beta2, t)
    decay = 1.0 - lr * weight_decay if decoupled else 1.0
    p = p * decay - lr * (m / bc1) / (torch.sqrt(v_used / bc2) + eps)
    return p, m, v, v_max, torch.tensor(float(t), dtype=torch.float64)


def global_norm_reference(
    grads: Tensor | Iterable[Tensor], gradient_scale: float = 1.0
) -> tuple[float, float, int]:
    """FP64 gradient statistics of docs/design.md section 2 over the unscaled gradients.

    The unscaled gradient is ``stored / gradient_scale`` (each tensor converted exactly
    to FP64 first). Non-finite elements (NaN, +-inf) are counted and excluded from the
    sum of squares and the maximum.

    Args:
        grads: one tensor or an iterable of tensors, any float dtype and shape.
        gradient_scale: the stored gradients are divided by this (default 1.0), finite
            and positive.

    Returns:
        ``(sum_of_squares, max_abs, nonfinite_count)`` as Python ``float``, ``float``,
        ``int``; ``(0.0, 0.0, 0)`` when there are no elements. The global norm is
        ``sqrt(sum_of_squares)``.
    """
    if not (math.isfinite(gradient_scale) and gradient_scale > 0.0):
        raise ValueError(f"gradient_scale must be finite and positive (got {gradient_scale})")
    tensors = [grads] if isinstance(grads, Tensor) else list(grads)
    sum_of_squares = 0.0
    max_abs = 0.0
    nonfinite = 0
    for index, tensor in enumerate(tensors):
        values = _to_float64(f"grads[{index}]", tensor).reshape(-1) / gradient_scale
        finite = torch.isfinite(values)
        nonfinite += int((~finite).sum().item())
        kept = values[finite]
        if kept.numel() > 0:
            sum_of_squares += float(torch.sum(kept * kept).item())
            max_abs = max(max_abs, float(kept.abs().max().item()))
    return sum_of_squares, max_abs, nonfinite


# ---- 8-bit codes (Note [8-bit moments] in csrc/quant8.h), defined by value, not by bits:
# every code's value in FP64, each q coded as the nearest value (ties to the even code).

_BLOCK_8BIT = 256


def _row_blocks(shape) -> tuple[int, int, int]:
    """(rows, row length, blocks per row): rows along the first dimension, a 0-D or 1-D
    tensor one row (Note [8-bit row blocks] in csrc/quant8.h)."""
    shape = tuple(shape)
    numel = math.prod(shape)
    n_rows, row = (1, numel) if len(shape) < 2 else (shape[0], math.prod(shape[1:]))
    return n_rows, row, -(-row // _BLOCK_8BIT)


def _scales_shape(shape, n_rows: int, per_row: int) -> tuple[int, ...]:
    return (per_row,) if len(tuple(shape)) < 2 else (n_rows, per_row)


def _magnitude_values(exponent_bits: int, mantissa_bits: int) -> Tensor:
    """FP64 value of every magnitude code, in code order (which is value order)."""
    top = 2**exponent_bits - 1
    values = []
    for code in range(2 ** (exponent_bits + mantissa_bits)):
        e, f = code >> mantissa_bits, code & (2**mantissa_bits - 1)
        if e == 0:
            values.append(f * 2.0 ** (1 - top - mantissa_bits))
        else:
            values.append(2.0 ** (e - top) * (1 + f / 2**mantissa_bits))
    return torch.tensor(values, dtype=torch.float64)


def _nearest_code(a: Tensor, table: Tensor) -> Tensor:
    """The code whose value is nearest to each a >= 0 (FP64), ties to the even code."""
    hi = torch.searchsorted(table, a).clamp(max=len(table) - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = (a - table[lo]).abs(), (table[hi] - a).abs()
    return torch.where((d_lo < d_hi) | ((d_lo == d_hi) & (lo % 2 == 0)), lo, hi)


def _code_table(code: str) -> Tensor:
    return _magnitude_values(3, 4) if code == "signed" else _magnitude_values(4, 4)


def quantize_8bit_reference(x: Tensor, code: str) -> tuple[Tensor, Tensor]:
    """``ruda_torch.ops.quantize_8bit`` by definition: per block (up to 256 consecutive
    elements of one row, rows along the first dimension: Note [8-bit row blocks]) the scale
    (largest finite magnitude, 0 below 2^-126; negated when the block holds a non-finite
    value), q = x * fp32(1 / |scale|) rounded to FP32 and the nearest code of q; a
    non-finite value gets its special code (signed: 0x7E with its sign for +-inf, 0x7F for
    NaN; unsigned: 0xFE for inf, 0xFF for NaN)."""
    if code not in ("signed", "unsigned"):
        raise ValueError(f"code must be 'signed' or 'unsigned', got {code!r}")
    n_rows, row, per_row = _row_blocks(x.shape)
    x32 = x.detach().to("cpu", torch.float32).reshape(n_rows, row)
    padded = torch.zeros(n_rows, per_row * _BLOCK_8BIT, dtype=torch.float32)
    padded[:, :row] = x32
    rows = padded.view(n_rows * per_row, _BLOCK_8BIT)  # one block per row of `rows`
    finite_values = torch.isfinite(rows)
    special = ~finite_values.all(dim=1)
    largest = torch.where(finite_values, rows.abs(), 0.0).amax(dim=1)
    stored = largest >= 2.0**-126
    magnitude_scale = torch.where(stored, largest, 0.0)
    scales = torch.where(special, -magnitude_scale, magnitude_scale)  # -0.0 where not stored
    inverse = torch.where(stored, 1.0 / torch.where(stored, largest, 1.0), 0.0)  # FP32
    q = torch.where(finite_values, rows * inverse[:, None], 0.0)  # FP32 products
    a = q.abs().double()
    table = _code_table(code)
    magnitude = _nearest_code(a.flatten(), table).view_as(a)
    if code == "signed":
        codes = torch.where(magnitude == 0, 0, magnitude | ((q < 0).long() << 7))
        inf_codes = torch.where(rows < 0, 0xFE, 0x7E)
        nan_code = 0x7F
    else:
        codes = torch.where((magnitude == 0) & (a > 0), 1, magnitude)
        inf_codes = torch.full_like(codes, 0xFE)
        nan_code = 0xFF
    codes = torch.where(torch.isinf(rows), inf_codes, codes)
    codes = torch.where(torch.isnan(rows), nan_code, codes)
    codes = codes.view(n_rows, per_row * _BLOCK_8BIT)[:, :row].to(torch.uint8)
    return codes.reshape(x.shape), scales.view(_scales_shape(x.shape, n_rows, per_row))


def dequantize_8bit_reference(codes: Tensor, scales: Tensor, code: str) -> Tensor:
    """FP32 values of (codes, scales): each code's exact value times its block's scale,
    rounded once to FP32; in a block whose scale has its sign bit set, the special codes
    are +-inf and NaN and the others are times |scale| (a NaN scale with the sign bit
    clear, the earlier format's block with a non-finite value, decodes as all NaN)."""
    n_rows, row, per_row = _row_blocks(codes.shape)
    if scales.dim() == 1 and n_rows > 1:  # the earlier format: blocks of the flat tensor
        n_rows, row, per_row = 1, codes.numel(), -(-codes.numel() // _BLOCK_8BIT)
    flat = codes.detach().cpu().reshape(n_rows, row).long()
    table = _code_table(code)
    if code == "signed":
        magnitude = flat & 0x7F
        sign = torch.where(flat >= 128, -1.0, 1.0).double()
        value = table[magnitude] * sign
        inf_code, nan_code = 0x7E, 0x7F
    else:
        magnitude = flat
        sign = torch.ones_like(flat, dtype=torch.float64)
        value = table[flat]
        inf_code, nan_code = 0xFE, 0xFF
    block = torch.arange(n_rows)[:, None] * per_row + torch.arange(row)[None, :] // _BLOCK_8BIT
    block_scales = scales.detach().cpu().double().flatten()[block]
    special = torch.signbit(block_scales)
    out = torch.where(special, value * block_scales.abs(), value * block_scales)
    out = torch.where(special & (magnitude == inf_code), sign * math.inf, out)
    out = torch.where(special & (magnitude == nan_code), math.nan, out)
    return out.float().view(codes.shape)
