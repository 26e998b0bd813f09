"""Every option of the optimizer in one place (docs/usage.md has what each means): the
param-group keys with their defaults (torch's own, and the fused path's), the
optimizer-wide options, what torch refuses of its keywords, how the fused path's options
depend on each other, and ``check_group``, the one check that runs wherever a group is
made, added, loaded or stepped, before anything is written."""

from __future__ import annotations

import torch

from ._build import check_device
from ._common import MIN_8BIT_SIZE, STATE_PRECISIONS, STATE_ROUNDINGS, local, master_kind
from ._validate import check_flat_param, check_hyperparameters, check_max_grad_norm
from .distributed import check_process_group, ranks_of

# torch.optim.AdamW's execution options: kept in every group so that state_dict() has
# torch's exact format, and ignored by this optimizer (whose update is always decoupled).
TORCH_GROUP_KEYS = dict(
    foreach=None, capturable=False, differentiable=False, fused=None, decoupled_weight_decay=True
)
# The fused path's param-group options besides fused_step, with their defaults.
FUSED_KEYS = dict(
    master_weights=False,
    stochastic_rounding=False,
    rounding_seed=0,
    flat_grads=False,
    state_precision="fp32",
    state_rounding="stochastic",
    min_8bit_size=MIN_8BIT_SIZE,
)
# Optimizer-wide options that change the math, and the last report: pickled with the
# optimizer (torch's Optimizer pickles only defaults, state and param_groups).
OPTIONS = dict(
    hierarchical_stats=False,
    max_grad_norm=None,
    process_group=None,
    partition_group=None,
    last_report=None,
)
# Optimizer-wide options that wrappers copy into group dicts (ZeroRedundancyOptimizer
# passes its keywords both ways, and syncs every group key into ours and back): see
# wide_keys_of.
GROUPS_KEYS = ("process_group", "partition_group")
WIDE_KEYS = ("hierarchical_stats", "max_grad_norm", *GROUPS_KEYS)


def torch_keywords(kw: dict, gi, default: bool = False) -> bool:
    """The meaning of torch.optim's execution keywords here (docs/usage.md, "torch's
    keywords"); returns fused_step. ``fused=True`` is ``fused_step=True`` (torch's name for
    the fused path); ``foreach`` and ``capturable`` are accepted and kept in the group, as
    torch keeps them. Their conflicts are check_torch_keywords'."""
    where = "" if gi is None else f" (param group {gi})"
    fused, fused_step = kw.get("fused"), kw.get("fused_step")
    if fused is not None and fused_step is not None and bool(fused) != bool(fused_step):
        raise ValueError(
            f"fused={fused} and fused_step={fused_step} disagree{where}: they are one setting "
            "(fused is torch's name for it); give one, or both the same"
        )
    if fused_step is not None:
        return bool(fused_step)
    return bool(fused) if fused is not None else bool(default)


# Note [torch's keywords]
# What torch.optim.Adam(W) refuses of its execution keywords is refused wherever a group is
# made ("construction"), added ("add"), loaded ("load") or stepped ("step"), before anything
# is written (docs/usage.md, "torch's keywords"). torch checks them in its constructor
# (ValueError for a Tensor lr or betas with foreach, RuntimeError for `fused` with foreach or
# differentiable) and finds the rest only at its step (RuntimeError): so a construction here
# raises torch's constructor error and every later place the RuntimeError of torch's step,
# with torch's words. differentiable=True is refused on either path (the generic one too:
# the step updates in place without autograd), and `fused` must agree with `fused_step`.


def check_tensor_hypers_with_foreach(group: dict, gi, when: str) -> None:
    """torch's first checks: a Tensor lr or Tensor betas with foreach=True needs
    capturable=True (before the values are checked, as torch orders them)."""
    where = "" if gi is None else f" (param group {gi})"
    foreach, capturable = group.get("foreach"), group.get("capturable")
    late = RuntimeError if when != "construction" else ValueError
    if foreach and not capturable:
        if isinstance(group.get("lr"), torch.Tensor):
            raise late(
                f"lr as a Tensor is not supported for capturable=False and foreach=True{where} "
                "(torch refuses it too): pass foreach=None, or capturable=True, or a float lr"
            )
        betas = group.get("betas")
        if isinstance(betas, (tuple, list)) and len(betas) == 2:
            for i, beta in enumerate(betas):
                if isinstance(beta, torch.Tensor) and isinstance(betas[1 - i], torch.Tensor):
                    raise ValueError(
                        f"betas[{i}] as a Tensor is not supported for capturable=False and "
                        f"foreach=True{where} (and ruda_torch takes float betas only)"
                    )


def check_execution_keywords(group: dict, gi, when: str) -> None:
    """differentiable, fused with foreach, fused against fused_step (torch checks the first
    two after the values)."""
    where = "" if gi is None else f" (param group {gi})"
    foreach = group.get("foreach")
    fused, fused_step = group.get("fused"), group.get("fused_step")
    on_fused_path = bool(fused) or bool(fused_step)
    if group.get("differentiable"):
        if on_fused_path:
            raise RuntimeError(
                f"`fused` does not support `differentiable`{where}: differentiable=True is not "
                "supported by the fused step (nor by torch's); use torch.optim for a "
                "differentiable optimizer step"
            )
        raise ValueError(
            f"differentiable=True is not supported{where}: ruda_torch's step updates the "
            "parameters in place without autograd (as torch's fused path, which refuses it "
            "too); use torch.optim for a differentiable optimizer step"
        )
    if fused and foreach:
        raise RuntimeError(
            f"`fused` and `foreach` cannot be `True` together{where} (torch's rule): fused=True "
            "is the fused step (fused_step=True); set foreach=None"
        )
    if fused is not None and fused_step is not None and bool(fused) != bool(fused_step):
        changed = " (one of them was changed since)" if when == "step" else ""
        raise ValueError(
            f"fused={fused} and fused_step={fused_step} disagree{where}{changed}: they are one "
            "setting (fused is torch's name for it); set both to the same value to choose "
            "the path"
        )


def check_precision(group: dict, where: str, dtype: torch.dtype) -> None:
    """Low-precision moments are for FP32, FP16 and BF16 parameters (FP64 ones keep FP64
    moments, Note [Parameter dtypes])."""
    precision = group.get("state_precision", "fp32")
    if precision != "fp32":
        raise ValueError(
            f"state_precision={precision!r} is for float32, float16 and bfloat16 parameters; "
            f"{where} is {dtype} (FP64 moments): use state_precision='fp32' for its group"
        )


# Our on/off options of the fused path: True or False, nothing that merely tests true (a
# string such as "fp32" taken as True would be a different master than asked for);
# master_weights also takes "remainder" (Note [Remainder master] in csrc/adamw_math.h).
FLAGS = ("master_weights", "stochastic_rounding", "flat_grads")


def check_flags(group: dict, where: str) -> None:
    for key in FLAGS:
        value = group.get(key, False)
        if isinstance(value, bool) or (
            key == "master_weights" and master_kind(group) == "remainder"
        ):
            continue
        if key == "master_weights":
            raise ValueError(
                f"master_weights must be True, False or 'remainder'{where}, got {value!r} "
                "(True: an FP32 master, 4 bytes per parameter; 'remainder': its low 16 bits "
                "beside a bfloat16 parameter, 2 bytes)"
            )
        raise ValueError(f"{key} must be True or False{where}, got {value!r}")


def check_group_options(group: dict, gi) -> None:
    """The param-group options of the fused path that depend on each other."""
    where = "" if gi is None else f" (param group {gi})"
    check_flags(group, where)
    if group.get("master_weights") and group.get("stochastic_rounding"):
        raise ValueError(
            f"master_weights={group['master_weights']!r} and stochastic_rounding=True exclude "
            f"each other{where}: the master keeps the exact value, stochastic rounding is the "
            "way to go without one"
        )
    if (
        group.get("master_weights") or group.get("stochastic_rounding") or group.get("flat_grads")
    ) and not group.get("fused_step"):
        raise ValueError(
            f"master_weights, stochastic_rounding and flat_grads require fused_step=True{where} "
            "(they are options of the native fused path)"
        )
    precision = group.get("state_precision", "fp32")
    if precision not in STATE_PRECISIONS:
        raise ValueError(
            f"state_precision must be one of {STATE_PRECISIONS}{where}, got {precision!r}"
        )
    if precision != "fp32" and not group.get("fused_step"):
        raise ValueError(
            f"state_precision={precision!r} requires fused_step=True{where} (low-precision "
            "moments are stored and rounded by the native fused kernel)"
        )
    size = group.get("min_8bit_size", MIN_8BIT_SIZE)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(
            f"min_8bit_size must be a non-negative int{where} (parameters with fewer elements "
            f"keep FP32 moments under state_precision='8bit' or '4bit'), got {size!r}"
        )
    if group.get("state_rounding", "stochastic") not in STATE_ROUNDINGS:
        raise ValueError(
            f"state_rounding must be one of {STATE_ROUNDINGS}{where}, got "
            f"{group.get('state_rounding')!r}"
        )
    seed = group.get("rounding_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"rounding_seed must be an int{where}, got {type(seed).__name__} {seed!r}")
    if not -(2**63) <= seed < 2**64:
        raise ValueError(
            f"rounding_seed must be a 64-bit value (-2**63 <= seed < 2**64){where}, got {seed}: "
            "the kernels hash its 64 bits, so a larger value would be reduced silently"
        )


def check_bucket_options(group: dict, gi: int, buckets: list) -> None:
    """What check_fused_param checks of a group's options per parameter dtype, per bucket
    (one dtype each): run before every step, where the options may have changed."""
    if master_kind(group) == "remainder" and any(b.dtype == torch.float16 for b in buckets):
        raise ValueError(_REMAINDER_FP16.format(where=f"param group {gi} has float16 parameters"))
    if group.get("stochastic_rounding") and any(b.dtype == torch.float16 for b in buckets):
        raise ValueError(
            f"stochastic_rounding=True is implemented for bfloat16 parameters; param group "
            f"{gi} has float16 parameters. Use master_weights=True for float16 parameters"
        )
    if any(b.dtype == torch.float64 for b in buckets):
        check_precision(group, f"param group {gi}", torch.float64)


def check_group(group: dict, gi, when: str, hierarchical_stats: bool) -> None:
    """Every check of one group's options, in torch's order where torch has them: called
    by the constructor (``when`` "construction", on the defaults), ``add_param_group``
    ("add"), ``load_state_dict`` ("load") and each step ("step"), so that a group changed
    through ``param_groups`` between steps takes effect or is refused before any write.
    A Tensor lr's value is read where torch reads it (not at a step: a host sync)."""
    check_tensor_hypers_with_foreach(group, gi, when)
    check_hyperparameters(
        group["lr"], group["betas"], group["eps"], group["weight_decay"],
        read_values=when != "step",
    )  # fmt: skip
    check_execution_keywords(group, gi, when)
    check_group_options(group, gi)
    if hierarchical_stats and not group.get("fused_step"):
        where = "" if gi is None else f" (param group {gi} has fused_step=False)"
        raise ValueError(
            f"hierarchical_stats=True requires fused_step=True in every param group{where}: "
            "the statistics feed the native fused kernel"
        )


def wide_keys_of(opt, param_group: dict) -> dict:
    """A group dict whose optimizer-wide options (which wrappers such as
    ZeroRedundancyOptimizer copy into every group and sync back and forth) agree with
    this optimizer's, with process groups replaced by the tuple of their ranks: a
    ProcessGroup cannot be pickled, and a group dict goes into ``state_dict()``."""
    if not any(k in param_group for k in WIDE_KEYS):
        return param_group
    group = dict(param_group)
    for k in ("hierarchical_stats", "max_grad_norm"):
        if k in group:
            value = group[k]
            ours = getattr(opt, k)
            if k == "max_grad_norm" and value is not None:
                value = check_max_grad_norm(value)
            if bool(value) != bool(ours) if k == "hierarchical_stats" else value != ours:
                raise ValueError(
                    f"a param group sets {k}={group[k]!r}, but {k} is an optimizer-wide "
                    f"option (this optimizer's is {ours!r}): pass it to "
                    f"ruda_torch.{type(opt).__name__}(...), not in a param group"
                )
    for k in GROUPS_KEYS:
        if k in group:
            group[k] = _group_description(opt, k, group[k])
    return group


def _group_description(opt, key: str, value):
    """The picklable form of a process group in a group dict (a tuple of ranks)."""
    if value is None or (isinstance(value, tuple) and all(isinstance(r, int) for r in value)):
        return value
    check_process_group(value, key)
    ranks = ranks_of(value, key)
    ours = getattr(opt, key)
    if ours is None or ranks_of(ours, key) != ranks:
        raise ValueError(
            f"a param group sets {key} to the group of ranks {list(ranks)}, but {key} "
            f"is an optimizer-wide option (this optimizer's is "
            f"{'None' if ours is None else list(ranks_of(ours, key))}): pass it to "
            f"ruda_torch.{type(opt).__name__}(...), not in a param group"
        )
    return ranks


FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# An FP16 value is not the high half of an FP32 one (its exponent has 5 bits): no 16-bit
# remainder makes its FP32 master exact.
_REMAINDER_FP16 = (
    "master_weights='remainder' keeps the low 16 bits of an FP32 master whose high 16 bits "
    "are the bfloat16 parameter; {where}, whose values are not the high half of an FP32 "
    "value. Use master_weights=True (an FP32 master) for float16 parameters"
)


def check_fused_param(p, gi: int, j: int, group=None, built: bool = True) -> None:
    """What the kernel needs of a parameter; a non-tensor is left to torch's own error.
    ``built=False`` (construction): a meta parameter is accepted, as torch's fused path
    does, so that an optimizer can be built before the model is materialized; the step
    checks the device."""
    if not isinstance(p, torch.Tensor):
        return
    where = f"param group {gi} parameter {j}"
    if p.dtype not in FUSED_DTYPES:
        raise ValueError(
            f"fused_step=True supports float32, float64, float16 and bfloat16 parameters; "
            f"{where} is {p.dtype}. Use fused_step=False for this group"
        )
    if group is not None and p.dtype == torch.float16 and group.get("stochastic_rounding"):
        raise ValueError(
            f"stochastic_rounding=True is implemented for bfloat16 parameters; {where} is "
            "float16. Use master_weights=True for float16 parameters"
        )
    if group is not None and p.dtype == torch.float16 and master_kind(group) == "remainder":
        raise ValueError(_REMAINDER_FP16.format(where=f"{where} is float16"))
    if group is not None and p.dtype == torch.float64:
        check_precision(group, where, p.dtype)
    if group is not None and group.get("flat_grads"):
        check_flat_param(p, where)
    t = local(p)
    if t.is_meta and not built:
        return
    if t.is_meta:
        raise RuntimeError(
            f"{where} is on the meta device, which holds no values to step: materialize the "
            "model (e.g. model.to_empty(device=...) and initialize it) before optimizer.step()"
        )
    check_device(t.device, "ruda_torch.AdamW(fused_step=True)")
