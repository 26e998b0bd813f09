"""The package's leaf: helpers and names every other module uses (it imports torch only,
so that the modules' imports form a DAG): the local shard of a tensor, dense layouts, the
state entries' keys and the option values that several modules check."""

from __future__ import annotations

import torch

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor, or the tensor itself (fast for plain tensors)."""
    if type(t) in _PLAIN_TYPES:
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one gap-free range of memory without overlap
    (at::Tensor::is_non_overlapping_and_dense, which Python does not expose): contiguous,
    or a permutation of a contiguous layout (Note [Dense layouts] in csrc/bindings.cpp)."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted(
        (st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


# ---- state entries: torch.optim.AdamW's keys, ours beside them

STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# The FP32 master copy of a 16-bit parameter (master_weights; Note [Master weights] in
# ruda_torch/_fused.py). torch.optim.AdamW carries it along as an unknown key.
MASTER_KEY = "master_param"
# Its low 16 bits, int16, beside a BF16 parameter (master_weights="remainder"; Note
# [Remainder master] in csrc/adamw_math.h).
REMAINDER_KEY = "master_remainder"
MASTER_KEYS = (MASTER_KEY, REMAINDER_KEY)


def master_kind(group: dict):
    """A group's master_weights as the buckets keep it: None, "fp32" or "remainder"."""
    value = group.get("master_weights")
    if isinstance(value, str) and value == "remainder":
        return "remainder"
    return "fp32" if value is True else None


REQUIRED_KEYS = ("step", "exp_avg", "exp_avg_sq")


# The keys of an 8-bit moment's pair (Note [8-bit state entries] in ruda_torch/_state8bit.py).
def codes_key(key: str) -> str:
    return key + "_codes"


def scales_key(key: str) -> str:
    return key + "_scales"


def pair_keys(moments) -> tuple[str, ...]:
    """The keys of the 8-bit pairs of ``moments``, in order."""
    return tuple(k for key in moments for k in (codes_key(key), scales_key(key)))


EIGHT_BIT_KEYS = pair_keys(STATE_KEYS)


# The keys of a 4-bit moment's pair (Note [4-bit state entries] in ruda_torch/_state4bit.py):
# names of their own, so that a pair's format is never guessed from its shapes.
def codes4_key(key: str) -> str:
    return key + "_codes4"


def scales4_key(key: str) -> str:
    return key + "_scales4"


def pair4_keys(moments) -> tuple[str, ...]:
    return tuple(k for key in moments for k in (codes4_key(key), scales4_key(key)))


FOUR_BIT_KEYS = pair4_keys(STATE_KEYS)
# Every key of a moment in a coded form (8-bit or 4-bit pairs).
CODED_KEYS = EIGHT_BIT_KEYS + FOUR_BIT_KEYS

# ---- option values checked in more than one module (docs/usage.md has their meaning)

STATE_PRECISIONS = ("fp32", "bf16", "8bit", "4bit")
STATE_ROUNDINGS = ("stochastic", "nearest")
# state_precision="8bit" or "4bit": parameters with fewer elements keep FP32 moments.
MIN_8BIT_SIZE = 4096


def own(
    buf: torch.Tensor, offset: int, shape: torch.Size | tuple, stride: tuple | None = None
) -> torch.Tensor:
    """A tensor of its own over ``buf``'s memory from element ``offset`` (Note [Tensors of
    their own] in csrc/py_records.h): contiguous when ``stride`` is None."""
    t = torch.empty(0, dtype=buf.dtype, device=buf.device)
    if stride is None:
        return t.set_(buf.untyped_storage(), buf.storage_offset() + offset, shape)
    return t.set_(buf.untyped_storage(), buf.storage_offset() + offset, shape, stride)


def entry_names(groups) -> dict:
    """Parameter index -> name, from the ``param_names`` that torch's state dicts carry
    for an optimizer built from ``named_parameters()`` (empty otherwise): for messages."""
    names = {}
    for g in groups if isinstance(groups, (list, tuple)) else ():
        if isinstance(g, dict) and isinstance(g.get("param_names"), (list, tuple)):
            names.update(zip(g.get("params", ()), g["param_names"], strict=False))
    return names


def entry_where(prefix: str, index, names: dict) -> str:
    """How a message names state entry ``index``: ``prefix[index]``, with its parameter's
    name where the state dict has one."""
    name = names.get(index)
    return f"{prefix}[{index!r}]" + (f" (parameter {name!r})" if name is not None else "")


def found(value) -> str:
    """What a state entry holds where a tensor was expected, for a message: "a meta tensor
    (torch.int16, which holds no values)", "a torch.float32 tensor", or the type's name."""
    if not isinstance(value, torch.Tensor):
        return type(value).__name__
    if value.is_meta:
        return f"a meta tensor ({value.dtype}, which holds no values)"
    return f"a {value.dtype} tensor"


def check_shape(value: torch.Tensor, p: torch.Tensor, key: str, where: str) -> None:
    if tuple(value.shape) != tuple(p.shape):
        raise ValueError(
            f"{where}[{key!r}] has shape {tuple(value.shape)} but its parameter has shape "
            f"{tuple(p.shape)}; a parameter's state must keep its shape (reset it with "
            "optimizer.state[p] = {} to start afresh)"
        )
