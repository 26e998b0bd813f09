"""Everything in Python that knows the remainder format of master weights
(``master_weights="remainder"``; the kernels' side is Note [Remainder master] in
csrc/adamw_math.h): a BF16 parameter's FP32 master kept as its low 16 bits, an int16
tensor shaped like the parameter under ``state[p]["master_remainder"]``, with

    master bits = (parameter bits << 16) + remainder   (int32 arithmetic, sign-extended)

The conversions below are what a load does between the two forms of a master: an FP32
master adopted by a remainder bucket, a remainder adopted by an FP32-master bucket, and
``master_weights_of`` (the FP32 masters, for torch or for inspection)."""

from __future__ import annotations

import torch

from ._common import MASTER_KEY, REMAINDER_KEY, local

# The int16 values a remainder can hold.
_LOW, _HIGH = -(2**15), 2**15 - 1


def _high_bits(p: torch.Tensor) -> torch.Tensor:
    """A BF16 tensor's bits as int64 in [0, 2^16), shifted to an FP32's high half."""
    return (p.view(torch.int16).to(torch.int64) & 0xFFFF) << 16


def master_from_remainder(p: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The FP32 masters of BF16 ``p`` from their remainders, as the kernels make them: a
    +-0 parameter over a negative remainder (which would carry through the sign bit) is its
    own master."""
    high = _high_bits(p.detach())
    bits = (high + remainder.detach().to(torch.int64)) & 0xFFFFFFFF
    bits = torch.where(((bits ^ high) >> 31) != 0, high, bits)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def remainder_of_master(p: torch.Tensor, master: torch.Tensor) -> torch.Tensor:
    """The remainders that make FP32 ``master`` from BF16 ``p``: exact where the parameter
    is the master rounded (to nearest, either way on a tie), except a tie rounded down to
    an even parameter, whose remainder (+32768) is one past int16: it takes 32767, a master
    one FP32 unit below. Where the parameter is not the master rounded (written since, or a
    NaN master) the remainder is 0: the master restarts from the parameter, as with no
    master at all."""
    bits = master.detach().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    diff = bits - _high_bits(p.detach())
    diff = torch.where(diff == 2**15, torch.full_like(diff, _HIGH), diff)
    nan = torch.isnan(master.detach())
    keep = (diff >= _LOW) & (diff <= _HIGH) & ~nan
    return torch.where(keep, diff, torch.zeros_like(diff)).to(torch.int16)


def master_weights_of(optimizer) -> dict:
    """The FP32 master of every parameter that has one, ``{param: tensor}``: the
    ``master_param`` of ``master_weights=True`` as it is, the master made from
    ``master_remainder`` and the parameter with ``master_weights="remainder"`` (a new
    tensor, local to this rank for a DTensor parameter)."""
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = optimizer.state.get(p) or {}
            if MASTER_KEY in entry:
                out[p] = entry[MASTER_KEY]
            elif REMAINDER_KEY in entry:
                out[p] = master_from_remainder(local(p), local(entry[REMAINDER_KEY]))
    return out
