"""Typed wrappers of the native operators (``torch.ops.ruda_torch.*``) and their fake
(meta) registrations, so that the operators work under FakeTensor, torch.compile and
``torch.library.opcheck``. The kernels are in csrc/; the schemas in csrc/ops.cpp.
"""

from __future__ import annotations

import math

import torch

from . import _C, _build  # noqa: F401  (loading _C registers the schemas)
from ._build import BLOCK_4BIT, BLOCK_8BIT
from ._common import STATE_ROUNDINGS

_ops = torch.ops.ruda_torch


def adamw_scaled_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: torch.Tensor | None,
    steps: torch.Tensor,
    slots: torch.Tensor,
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
    max_grad_norm: float = 0.0,
    clip_coef: torch.Tensor | None = None,
    master: torch.Tensor | None = None,
    lr_tensor: torch.Tensor | None = None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    decoupled: bool = True,
    state_rounding: str = "stochastic",
    scales: torch.Tensor | None = None,
) -> None:
    """In-place AdamW/AMSGrad over one bucket (docs/semantics.md); with
    ``decoupled=False`` Adam's L2 decay instead (``weight_decay * param`` added to the
    gradient, Note [Weight decay modes] in csrc/adamw_math.h).

    ``params[i]`` (one dtype: FP32, FP64, FP16 or BF16; dense, i.e. contiguous or a
    permutation of a contiguous layout such as a transpose or channels_last) owns the
    elements ``[off, off + numel)`` of the flat state buffers, in its memory order, and the
    step counter ``steps[sid]``, where ``(off, sid) = slots[i]`` (a CPU int64 tensor of
    shape ``[len(params), 2]``). The state buffers are FP64 for FP64 parameters and FP32
    otherwise, or BF16 moments for non-FP64 parameters (all three buffers BF16: Note
    [Low-precision states] in csrc/adamw_math.h), stored rounded as ``state_rounding``
    says: ``"stochastic"`` (random bits from ``seed``, the step counter, the element's
    state offset and the moment) or ``"nearest"`` (even). Or 8-bit moments: uint8
    buffers of codes and scales (``pack_8bit``; every slice starts a block of 256; Note
    [8-bit moments] in csrc/quant8.h), decoded, updated in FP32 and coded again with each
    block's new scale in one pass, rounded to nearest; with ``scales`` (FP32) the moment
    buffers hold the codes alone (a whole number of blocks) and ``scales`` a run of scales
    per moment in turn (``exp_avg``'s, ``exp_avg_sq``'s, ``max_exp_avg_sq``'s, runs of
    equal length, at least one per block each), as the optimizer's buckets keep them:
    then ``slots`` may be ``[len(params), 4]``, ``(off, sid, row, first)``, where a
    contiguous parameter of rows of ``row`` elements that are not whole blocks has its
    blocks per row (Note [8-bit row blocks] in csrc/quant8.h) and their scales from
    ``first`` of each run (``row`` 0: the flat tensor's blocks, scales at ``off / 256``). ``grads`` share one dtype (FP32, FP16 or BF16 for FP32 parameters; the
    parameters' dtype or FP32 for 16-bit ones; FP64 for FP64 ones), lay out their elements
    as their parameters do, and are never written.

    16-bit parameters (Note [Parameter dtypes] in csrc/adamw_math.h): the update is
    computed in FP32 from ``master`` (a flat FP32 buffer like ``exp_avg``, updated in
    place) when given, else from the parameter, and written back rounded to nearest even;
    an int16 ``master`` (BF16 parameters) holds the FP32 masters' low 16 bits, the
    parameter their high 16 rounded ties away (Note [Remainder master] in
    csrc/adamw_math.h);
    or for BF16 without ``master`` stochastically with ``stochastic_rounding`` (random
    bits from ``seed``, the step counter and the element's state offset). A Tensor lr
    (one floating element, as ``lr=`` or ``lr_tensor=``) replaces the float: on the CPU
    it is read at the call, on the parameters' device by the kernel. ``grad_scale``/``found_inf``
    (1 element), ``stats`` (the 3-float report) and ``clip_coef`` (1 element; FP32, or FP64
    for FP64 parameters, clip_grad_norm_'s precision there) live on
    the parameters' device and are read by the kernel: no host sync. The step is skipped
    (nothing written, counters unchanged) when ``found_inf != 0`` or ``stats[2] != 0``.
    The step is also skipped when ``grad_scale`` is not a positive finite number
    (Note [Step counter range] has the companion rule for step counters).
    """
    _call(
        _ops.adamw_scaled_, params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots,
        lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
        grad_scale=grad_scale, found_inf=found_inf, stats=stats, max_grad_norm=max_grad_norm,
        clip_coef=clip_coef, master=master, lr_tensor=lr_tensor,
        stochastic_rounding=stochastic_rounding, seed=seed, decoupled=decoupled,
        state_rounding=state_rounding, scales=scales,
    )  # fmt: skip


def check_adamw_scaled(*args, **kwargs) -> None:
    """Validate the arguments of :func:`adamw_scaled_` (same signature) and write nothing:
    raises exactly what ``adamw_scaled_`` would raise for them."""
    _call(_ops.check_adamw_scaled, *args, **kwargs)


def _call(
    op,
    params,
    grads,
    exp_avg,
    exp_avg_sq,
    max_exp_avg_sq,
    steps,
    slots,
    *,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    maximize=False,
    grad_scale=None,
    found_inf=None,
    stats=None,
    max_grad_norm=0.0,
    clip_coef=None,
    master=None,
    lr_tensor=None,
    stochastic_rounding=False,
    seed=0,
    decoupled=True,
    state_rounding="stochastic",
    scales=None,
) -> None:
    lr, lr_tensor = _lr_args(lr, lr_tensor)
    rounding = rounding_code(stochastic_rounding, state_rounding, exp_avg.dtype)
    op(
        params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots,
        grad_scale, found_inf, stats, clip_coef,
        lr, beta1, beta2, eps, weight_decay, max_grad_norm, maximize,
        master=master, lr_tensor=lr_tensor, rounding=rounding, seed=_seed64(seed),
        decoupled=bool(decoupled), scales=scales,
    )  # fmt: skip


def flat_step(
    handle,
    active: list[int] | None,
    *,
    validate_only: bool,
    amsgrad: bool,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    stats: torch.Tensor | None,
    max_grad_norm: float,
    clip_coef: torch.Tensor | None,
    stochastic_rounding: bool,
    seed: int,
    decoupled: bool = True,
    state_rounding: str = "stochastic",
    state_dtype: torch.dtype = torch.float32,
) -> None:
    """:func:`adamw_scaled_` over a flat-gradient bucket's handle (Note [Flat gradient
    buckets] in csrc/bindings.h): the tensors are the handle's, validated when it was
    made; ``active`` lists the parameters to step (None: all). Private to the optimizer:
    the handle is not an operator argument, so this is not traceable."""
    lr, lr_tensor = _lr_args(lr, None)
    _C.flat_step(
        handle, active, validate_only, bool(amsgrad), float(lr), lr_tensor, float(beta1), float(beta2),
        float(eps), float(weight_decay), bool(maximize), grad_scale, found_inf, stats,
        float(max_grad_norm), clip_coef,
        rounding_code(stochastic_rounding, state_rounding, state_dtype), _seed64(seed),
        bool(decoupled),
    )  # fmt: skip


def _lr_args(lr, lr_tensor):
    """(float lr, Tensor lr or None): a Tensor lr may come as lr= too, and is given to the
    kernels as FP32 or FP64 (another floating dtype is converted; the rest is the binding's
    error)."""
    if isinstance(lr, torch.Tensor):
        lr, lr_tensor = 0.0, lr
    if (
        lr_tensor is not None
        and lr_tensor.is_floating_point()
        and lr_tensor.dtype not in (torch.float32, torch.float64)
    ):
        lr_tensor = lr_tensor.to(torch.float64)
    return lr, lr_tensor


def rounding_code(stochastic_rounding: bool, state_rounding: str, state_dtype) -> int:
    """The schema's ``rounding``: bit 0 stochastic rounding of BF16 parameters, bit 1 of
    BF16 moments (``state_rounding`` matters only for those)."""
    if state_rounding not in STATE_ROUNDINGS:
        raise ValueError(f"state_rounding must be one of {STATE_ROUNDINGS}, got {state_rounding!r}")
    code = 1 if stochastic_rounding else 0
    if state_dtype == torch.bfloat16 and state_rounding == "stochastic":
        code |= 2
    return code


def _seed64(seed: int) -> int:
    """The seed as the schema's signed int64 (its 64 bits are what the kernel hashes)."""
    seed = int(seed) & (2**64 - 1)
    return seed - 2**64 if seed >= 2**63 else seed


def analyze_gradient(
    grads: list[torch.Tensor], rows: torch.Tensor, grad_scale: torch.Tensor | None = None
) -> None:
    """Write one statistics row ``[sum_sq, max_abs, nonfinite]`` per
    ``STATS_CHUNK`` elements of each gradient into ``rows`` (shape ``[R, 3]``)."""
    _ops.analyze_gradient(grads, grad_scale, rows)


def merge_gradient_stats(rows: torch.Tensor, out: torch.Tensor) -> None:
    """One reduction level: ``out[k]`` combines ``rows[1024 k : 1024 (k + 1)]``."""
    _ops.merge_gradient_stats(rows, out)


def merge_gradient_stats_chunks(reports: torch.Tensor, out: torch.Tensor) -> None:
    """Left fold of the ``[k, 3]`` reports, in order, into the 3-element ``out``."""
    _ops.merge_gradient_stats_chunks(reports, out)


def stats_rows_for(numel: int) -> int:
    """Statistics rows that ``analyze_gradient`` writes for a tensor of ``numel`` elements."""
    return -(-numel // _build.STATS_CHUNK)


# Fake registrations: every operator mutates preallocated storage and returns nothing.
# They run under FakeTensor/torch.compile, and also eagerly when any argument is a meta
# tensor: then the arguments must all be on one device, or a CPU call with one stray meta
# tensor would silently do nothing (`slots` is host metadata and always on the CPU).
def _same_device(op: str, named) -> None:
    """Raise unless every tensor in ``named`` ((name, tensor, list or None) pairs) is on
    one device."""
    first = None
    for name, value in named:
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for i, t in enumerate(tensors):
            if t is None:
                continue
            label = f"{name}[{i}]" if isinstance(value, (list, tuple)) else name
            if first is None:
                first = (label, t.device)
            elif t.device != first[1]:
                raise RuntimeError(
                    f"ruda_torch.{op}: {label} is on {t.device} but {first[0]} is on "
                    f"{first[1]}; all tensors must be on one device"
                )


CODES_8BIT = ("signed", "unsigned")


def _code8(op: str, code: str) -> int:
    if code not in CODES_8BIT:
        raise ValueError(
            f"ruda_torch.ops.{op}: code must be 'signed' (exp_avg: sign + E3M4) or "
            f"'unsigned' (exp_avg_sq: E4M4), got {code!r}"
        )
    return CODES_8BIT.index(code)


def rows_8bit(shape) -> tuple[int, int]:
    """``(rows, row length)`` of a tensor of ``shape`` as 8-bit codes cut it into blocks
    (Note [8-bit row blocks] in csrc/quant8.h): rows along the first dimension, each the
    product of the others; a 0-D or 1-D tensor is one row."""
    shape = tuple(shape)
    numel = math.prod(shape)
    if len(shape) < 2:
        return 1, numel
    return shape[0], math.prod(shape[1:])


def scales_shape_8bit(shape) -> tuple[int, ...]:
    """The shape of the scales of a tensor of ``shape`` (Note [8-bit row blocks] in
    csrc/quant8.h): ``(rows, blocks per row)``, or ``(blocks,)`` for a 0-D or 1-D tensor.
    Defined on the shape alone, so that a shard along the first dimension has the scales
    of its rows."""
    rows, row = rows_8bit(shape)
    per_row = -(-row // BLOCK_8BIT)
    return (per_row,) if len(tuple(shape)) < 2 else (rows, per_row)


def ragged_row_8bit(shape) -> int:
    """The row length of a tensor of ``shape`` whose rows are not whole blocks of
    ``BLOCK_8BIT`` and are more than one (Note [8-bit row blocks] in csrc/quant8.h: its
    blocks are then not the flat tensor's), else 0 (its rows' blocks are the flat
    tensor's)."""
    rows, row = rows_8bit(shape)
    return row if rows > 1 and row % BLOCK_8BIT else 0


def _padded_rows(shape) -> tuple[int, int, int] | None:
    """(rows, row length, padded row length) where the blocks are not the flat tensor's
    (ragged_row_8bit; its codes are then coded row by row); None otherwise."""
    row = ragged_row_8bit(shape)
    if not row:
        return None
    return rows_8bit(shape)[0], row, -(-row // BLOCK_8BIT) * BLOCK_8BIT


def quantize_8bit(x: torch.Tensor, code: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise 8-bit codes of an FP32 tensor (Note [8-bit moments] and Note [8-bit row
    blocks] in csrc/quant8.h): ``(codes, scales)``, ``codes`` uint8 shaped like ``x``,
    ``scales`` FP32 of shape ``scales_shape_8bit(x.shape)``: the largest magnitude of each
    block of up to ``BLOCK_8BIT`` consecutive elements of one row of ``x`` (rows along the
    first dimension; a row's last block shorter). ``code``: ``"signed"`` (a first moment)
    or ``"unsigned"`` (a second moment, which stores magnitudes). Writes nothing else; on
    CPU and CUDA, with the same bits. This is the format of ``state_precision="8bit"``'s
    state entries."""
    c = _code8("quantize_8bit", code)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(
            "ruda_torch.ops.quantize_8bit: x must be a float32 tensor (got "
            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__})"
        )
    padded = _padded_rows(x.shape)
    scales = torch.empty(scales_shape_8bit(x.shape), dtype=torch.float32, device=x.device)
    if padded is None:
        x = x.contiguous()
        codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        torch.ops.ruda_torch.quantize_8bit(x, codes, scales.view(-1), c)
        return codes, scales
    rows, row, stride = padded  # each row on whole blocks, zeros after it (no scale changes)
    staging = torch.zeros(rows, stride, dtype=torch.float32, device=x.device)
    staging[:, :row] = x.reshape(rows, row)
    codes = torch.empty(rows, stride, dtype=torch.uint8, device=x.device)
    torch.ops.ruda_torch.quantize_8bit(staging, codes, scales.view(-1), c)
    return codes[:, :row].reshape(x.shape), scales


def packed_8bit_bytes(numel: int) -> int:
    """Bytes of a flat 8-bit moment buffer for ``numel`` elements (Note [8-bit moments] in
    csrc/quant8.h): the codes of whole blocks of 256, then one FP32 scale per block."""
    return -(-numel // BLOCK_8BIT) * (BLOCK_8BIT + 4)


def pack_8bit(x: torch.Tensor, code: str) -> torch.Tensor:
    """A flat 8-bit moment buffer (uint8, ``packed_8bit_bytes(x.numel())`` bytes) holding
    ``x``'s codes, padded with zero codes to whole blocks, then the blocks' scales: what
    ``adamw_scaled_`` takes as ``exp_avg`` / ``exp_avg_sq`` / ``max_exp_avg_sq`` for
    8-bit moments."""
    codes, scales = quantize_8bit(x.reshape(-1), code)  # the flat tensor's blocks
    n_blocks = scales.numel()
    out = torch.zeros(packed_8bit_bytes(x.numel()), dtype=torch.uint8, device=x.device)
    out[: codes.numel()] = codes.flatten()
    out[n_blocks * BLOCK_8BIT :].view(torch.float32).copy_(scales)
    return out


def unpack_8bit(buffer: torch.Tensor, code: str, numel: int | None = None) -> torch.Tensor:
    """The FP32 values of a flat 8-bit moment buffer (its first ``numel`` elements; all of
    them by default)."""
    n_blocks = buffer.numel() // (BLOCK_8BIT + 4)
    if buffer.dtype != torch.uint8 or buffer.numel() != n_blocks * (BLOCK_8BIT + 4):
        raise ValueError(
            "ruda_torch.ops.unpack_8bit: buffer must be a uint8 tensor of whole blocks "
            f"({BLOCK_8BIT + 4} bytes each), got {buffer.dtype} of {buffer.numel()} elements"
        )
    capacity = n_blocks * BLOCK_8BIT
    numel = capacity if numel is None else numel
    scales = buffer[capacity:].view(torch.float32)
    return dequantize_8bit(buffer[:capacity], scales, code)[:numel]


def dequantize_8bit(
    codes: torch.Tensor, scales: torch.Tensor, code: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The FP32 values of quantize_8bit's ``(codes, scales)``, shaped like ``codes`` (into
    ``out`` when given: a contiguous FP32 tensor of as many elements). ``scales`` of
    ``scales_shape_8bit(codes.shape)``; or, for the earlier format of a tensor of two or
    more dimensions, one-dimensional with one scale per block of ``BLOCK_8BIT`` codes of
    the flat tensor."""
    c = _code8("dequantize_8bit", code)
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    padded = _padded_rows(codes.shape)
    if padded is None or scales.dim() == 1:  # flat blocks (or the earlier format's)
        torch.ops.ruda_torch.dequantize_8bit(codes.contiguous(), scales.reshape(-1), out, c)
        return out
    if tuple(scales.shape) != scales_shape_8bit(codes.shape):
        raise ValueError(
            f"ruda_torch.ops.dequantize_8bit: codes of shape {tuple(codes.shape)} take scales "
            f"of shape {scales_shape_8bit(codes.shape)} (one per block of each row), got "
            f"{tuple(scales.shape)}"
        )
    rows, row, stride = padded
    staging = torch.zeros(rows, stride, dtype=torch.uint8, device=codes.device)
    staging[:, :row] = codes.reshape(rows, row)
    values = torch.empty(rows, stride, dtype=torch.float32, device=codes.device)
    torch.ops.ruda_torch.dequantize_8bit(staging, scales.reshape(-1), values, c)
    out.view(rows, row).copy_(values[:, :row])
    return out


CODES_4BIT = ("signed", "unsigned")


def _code4(op: str, code: str) -> int:
    if code not in CODES_4BIT:
        raise ValueError(
            f"ruda_torch.ops.{op}: code must be 'signed' (exp_avg: sign + E2M1) or "
            f"'unsigned' (exp_avg_sq: E2M2), got {code!r}"
        )
    return CODES_4BIT.index(code)


def scales_shape_4bit(shape) -> tuple[int, ...]:
    """The shape of the scales of a tensor of ``shape`` in 4 bits (Note [4-bit row blocks]
    in csrc/quant4.h): ``(rows, blocks of 128 per row)``, or ``(blocks,)`` for a 0-D or 1-D
    tensor."""
    rows, row = rows_8bit(shape)
    per_row = -(-row // BLOCK_4BIT)
    return (per_row,) if len(tuple(shape)) < 2 else (rows, per_row)


def codes_shape_4bit(shape) -> tuple[int, ...]:
    """The shape of the 4-bit codes of a tensor of ``shape`` (Note [4-bit row blocks] in
    csrc/quant4.h): two codes per byte along the last dimension, which must be even:
    ``(*shape[:-1], shape[-1] // 2)``. The parameter's shape is read back from it, and a
    shard along any but the last dimension holds its elements' whole bytes."""
    shape = tuple(shape)
    if not shape or shape[-1] % 2:
        raise ValueError(
            f"4-bit codes pair the elements along the last dimension, which must be even; a "
            f"tensor of shape {shape} has none to pair (state_precision='4bit' keeps such "
            "parameters in 8 bits)"
        )
    return (*shape[:-1], shape[-1] // 2)


def shape_of_codes_4bit(codes_shape) -> tuple[int, ...]:
    """The tensor's shape from its 4-bit codes' (codes_shape_4bit's inverse)."""
    codes_shape = tuple(codes_shape)
    return (*codes_shape[:-1], 2 * codes_shape[-1]) if codes_shape else ()


def ragged_row_4bit(shape) -> int:
    """The row length of a tensor of ``shape`` whose rows are not whole blocks of
    ``BLOCK_4BIT`` and are more than one (Note [4-bit row blocks] in csrc/quant4.h), else 0."""
    rows, row = rows_8bit(shape)
    return row if rows > 1 and row % BLOCK_4BIT else 0


def quantize_4bit(x: torch.Tensor, code: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise 4-bit codes of an FP32 tensor (Note [4-bit moments] in csrc/quant4.h):
    ``(codes, scales)``, ``codes`` uint8 of ``codes_shape_4bit(x.shape)`` (two codes per
    byte, the even element in the low nibble; the last dimension must be even), ``scales``
    FP32 of ``scales_shape_4bit(x.shape)``: the largest magnitude of each block of up to
    ``BLOCK_4BIT`` consecutive elements of one row (rows along the first dimension).
    ``code``: ``"signed"`` (a first moment) or ``"unsigned"`` (a second moment). The format
    of ``state_precision="4bit"``'s state entries; CPU or CUDA tensors, the same bits."""
    c = _code4("quantize_4bit", code)
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        raise TypeError(
            "ruda_torch.ops.quantize_4bit: x must be a float32 tensor (got "
            f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__})"
        )
    codes = torch.empty(codes_shape_4bit(x.shape), dtype=torch.uint8, device=x.device)
    scales = torch.empty(scales_shape_4bit(x.shape), dtype=torch.float32, device=x.device)
    rows, row = rows_8bit(x.shape)
    if not ragged_row_4bit(x.shape):  # the flat tensor's blocks
        torch.ops.ruda_torch.quantize_4bit(x.contiguous().view(-1), codes.view(-1),
                                           scales.view(-1), c)  # fmt: skip
        return codes, scales
    stride = -(-row // BLOCK_4BIT) * BLOCK_4BIT  # each row on whole blocks, zeros after it
    staging = torch.zeros(rows, stride, dtype=torch.float32, device=x.device)
    staging[:, :row] = x.reshape(rows, row)
    padded = torch.empty(rows, stride // 2, dtype=torch.uint8, device=x.device)
    torch.ops.ruda_torch.quantize_4bit(staging.view(-1), padded.view(-1), scales.view(-1), c)
    codes.view(rows, row // 2).copy_(padded[:, : row // 2])
    return codes, scales


def dequantize_4bit(codes: torch.Tensor, scales: torch.Tensor, code: str) -> torch.Tensor:
    """The FP32 values of quantize_4bit's ``(codes, scales)``, of shape
    ``shape_of_codes_4bit(codes.shape)``."""
    c = _code4("dequantize_4bit", code)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8 or codes.dim() == 0:
        raise ValueError(
            "ruda_torch.ops.dequantize_4bit: codes must be a uint8 tensor of at least one "
            f"dimension (two codes per byte), got {codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__}"
        )
    shape = shape_of_codes_4bit(codes.shape)
    want = scales_shape_4bit(shape)
    if (
        not isinstance(scales, torch.Tensor)
        or scales.dtype != torch.float32
        or tuple(scales.shape) != want
    ):
        raise ValueError(
            f"ruda_torch.ops.dequantize_4bit: the scales of codes of shape {tuple(codes.shape)} "
            f"(a tensor of shape {shape}) are a float32 tensor of shape {want}, got "
            + (f"{scales.dtype} of shape {tuple(scales.shape)}" if isinstance(scales, torch.Tensor)
               else type(scales).__name__)
        )  # fmt: skip
    rows, row = rows_8bit(shape)
    out = torch.empty(shape, dtype=torch.float32, device=codes.device)
    if not ragged_row_4bit(shape):
        torch.ops.ruda_torch.dequantize_4bit(codes.contiguous().view(-1),
                                             scales.contiguous().view(-1), out.view(-1), c)  # fmt: skip
        return out
    stride = -(-row // BLOCK_4BIT) * BLOCK_4BIT
    staging = torch.zeros(rows, stride // 2, dtype=torch.uint8, device=codes.device)
    staging[:, : row // 2] = codes.reshape(rows, row // 2)
    values = torch.empty(rows, stride, dtype=torch.float32, device=codes.device)
    torch.ops.ruda_torch.dequantize_4bit(staging.view(-1), scales.contiguous().view(-1),
                                         values.view(-1), c)  # fmt: skip
    out.view(rows, row).copy_(values[:, :row])
    return out


@torch.library.register_fake("ruda_torch::adamw_scaled_")
def _adamw_scaled_fake(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots,
                       grad_scale, found_inf, stats, clip_coef, lr, beta1, beta2, eps,
                       weight_decay, max_grad_norm, maximize, *, master=None, lr_tensor=None,
                       rounding=0, seed=0, decoupled=True, scales=None):  # fmt: skip
    _same_device("adamw_scaled_", [
        ("params", params), ("grads", grads), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq),
        ("max_exp_avg_sq", max_exp_avg_sq), ("steps", steps), ("grad_scale", grad_scale),
        ("found_inf", found_inf), ("stats", stats), ("clip_coef", clip_coef), ("master", master),
        ("scales", scales),
    ])  # fmt: skip
    if slots.is_meta and exp_avg.device.type != "meta":
        raise RuntimeError(
            "ruda_torch.adamw_scaled_: slots is a meta tensor; it must be a CPU int64 tensor"
        )
    if lr_tensor is not None and lr_tensor.is_meta and exp_avg.device.type != "meta":
        raise RuntimeError(
            f"ruda_torch.adamw_scaled_: lr_tensor is a meta tensor; it must be on the CPU or "
            f"on {exp_avg.device} with the parameters"
        )


@torch.library.register_fake("ruda_torch::check_adamw_scaled")
def _check_adamw_scaled_fake(*args, **kwargs):
    _adamw_scaled_fake(*args, **kwargs)


@torch.library.register_fake("ruda_torch::analyze_gradient")
def _analyze_gradient_fake(grads, grad_scale, rows):
    _same_device("analyze_gradient", [("grads", grads), ("grad_scale", grad_scale), ("rows", rows)])


@torch.library.register_fake("ruda_torch::merge_gradient_stats")
def _merge_gradient_stats_fake(rows, out):
    _same_device("merge_gradient_stats", [("rows", rows), ("out", out)])


@torch.library.register_fake("ruda_torch::merge_gradient_stats_chunks")
def _merge_gradient_stats_chunks_fake(reports, out):
    _same_device("merge_gradient_stats_chunks", [("reports", reports), ("out", out)])


@torch.library.register_fake("ruda_torch::quantize_8bit")
def _quantize_8bit_fake(x, codes, scales, code):
    _same_device("quantize_8bit", [("x", x), ("codes", codes), ("scales", scales)])


@torch.library.register_fake("ruda_torch::dequantize_8bit")
def _dequantize_8bit_fake(codes, scales, out, code):
    _same_device("dequantize_8bit", [("codes", codes), ("scales", scales), ("out", out)])


@torch.library.register_fake("ruda_torch::quantize_4bit")
def _quantize_4bit_fake(x, codes, scales, code):
    _same_device("quantize_4bit", [("x", x), ("codes", codes), ("scales", scales)])


@torch.library.register_fake("ruda_torch::dequantize_4bit")
def _dequantize_4bit_fake(codes, scales, out, code):
    _same_device("dequantize_4bit", [("codes", codes), ("scales", scales), ("out", out)])
