"""The generic path (``fused_step=False``): docs/design.md section 1 with torch tensor operations,
one parameter at a time, on any device and dtype torch supports (FP64, 16-bit and
complex parameters included). No host sync: skip and bias corrections are computed from
device values."""

from __future__ import annotations

import torch

from ._common import STATE_KEYS, local
from ._validate import check_required_keys, step_value


def check_generic(group_index: int, indexed: list, grads: list) -> None:
    """Everything ``update`` needs of a parameter and its gradient, checked for the whole
    step before anything is written (Note [Atomic step] in ruda_torch/optimizer.py).
    Stricter than torch, whose for-loop path broadcasts a gradient of another shape."""
    for (j, p), g in zip(indexed, grads, strict=True):
        where = f"param group {group_index} parameter {j}"
        if g.is_sparse:
            raise RuntimeError(
                f"ruda_torch.AdamW does not support sparse gradients ({where}); use a dense "
                "gradient (e.g. nn.Embedding(sparse=False))"
            )
        if not (p.is_floating_point() or p.is_complex()):
            raise ValueError(
                f"ruda_torch.AdamW updates floating or complex parameters; {where} is {p.dtype}"
            )
        if g.shape != p.shape:
            raise ValueError(
                f"the gradient of {where} has shape {tuple(g.shape)} but the parameter has "
                f"shape {tuple(p.shape)}"
            )
        if g.is_complex() != p.is_complex() or not (g.is_floating_point() or g.is_complex()):
            raise ValueError(f"the gradient of {where} is {g.dtype} for a {p.dtype} parameter")
        if g.device != p.device:
            raise ValueError(
                f"the gradient of {where} is on {g.device} but the parameter on {p.device}"
            )


def check_entry(st, p: torch.Tensor, amsgrad: bool, where: str) -> bool:
    """A state entry ``update`` can use (keys, moment shapes, a step counter it can add
    to); True when a Python-number step must become a tensor first (phase 2). The value of
    a tensor counter is not read (that would be a host sync per parameter): the update's
    arithmetic clamps it (Note [Step counter range])."""
    check_required_keys(st, where, eight_bit=False)
    for key in STATE_KEYS:
        v = st.get(key)
        if v is not None and (not isinstance(v, torch.Tensor) or v.shape != p.shape):
            got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"{where}[{key!r}] must be a tensor of shape {tuple(p.shape)}, "
                             f"got {got}")  # fmt: skip
    step = st["step"]
    if isinstance(step, torch.Tensor) and step.is_floating_point():
        if step.numel() != 1 or step.is_meta:
            kind = "a meta tensor" if step.is_meta else f"shape {tuple(step.shape)}"
            raise ValueError(f"{where}['step'] must be a one-element tensor with a value, "
                             f"got {kind}")  # fmt: skip
        return False
    step_value(step, where)  # a number or an integer tensor: checked, then made FP32
    return True


def fresh_state(p: torch.Tensor, amsgrad: bool) -> dict:
    st = {
        "step": torch.zeros((), dtype=torch.float32, device=local(p).device),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }
    if amsgrad:
        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return st


def update(p, grad, st, group, grad_scale, found_inf, clip_coef) -> None:
    """One parameter's update. Bias corrections are computed from the device step counter
    in FP64 and cast once, as in the kernels (Note [Bias correction])."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    if isinstance(lr, torch.Tensor):
        lr = lr.reshape(())  # torch accepts any one-element shape ([1], [1, 1], ...)
    # DTensor parameters are updated through their local shards, like the fused path.
    p, grad = local(p), local(grad)
    st = {k: local(v) for k, v in st.items()}
    if torch.is_complex(p):
        p, grad = torch.view_as_real(p), torch.view_as_real(grad)
        st = {k: (torch.view_as_real(v) if k != "step" else v) for k, v in st.items()}
    skip = None if found_inf is None else (found_inf.reshape(()) != 0)
    if grad_scale is not None:  # as the kernels: a scale that cannot divide skips the step
        bad_scale = ~((grad_scale.reshape(()) > 0) & torch.isfinite(grad_scale.reshape(())))
        skip = bad_scale if skip is None else (skip | bad_scale)
    step_t = st["step"]
    if skip is None:
        step_t += 1
    else:
        step_t += (~skip).to(step_t.dtype)
    g = grad.to(p.dtype) if grad.dtype != p.dtype else grad
    factor = None
    if clip_coef is not None:
        factor = clip_coef.reshape(()).to(p.dtype)
    if grad_scale is not None:
        inv = 1.0 / grad_scale.reshape(()).to(p.dtype)
        factor = inv if factor is None else factor * inv
    if factor is not None:
        g = g * factor
    if group["maximize"]:
        g = -g
    decoupled = group.get("decoupled_weight_decay", True)
    if not decoupled and wd != 0:  # Adam's L2 (Note [Weight decay modes] in adamw_math.h)
        g = g + wd * p
    # Note [Step counter range]: the counter as the kernels read it.
    t64 = step_t.to(torch.float64).nan_to_num(nan=1.0).clamp(1.0, 2.0**62).floor()
    bc1 = (1.0 - torch.pow(beta1, t64)).to(p.dtype)
    bc2 = (1.0 - torch.pow(beta2, t64)).to(p.dtype)
    m, v = st["exp_avg"], st["exp_avg_sq"]
    m_new = m * beta1 + g * (1.0 - beta1)
    v_new = v * beta2 + (g * g) * (1.0 - beta2)
    v_used = v_new
    vmax_new = None
    if group["amsgrad"]:
        vmax_new = torch.maximum(st["max_exp_avg_sq"], v_new)
        v_used = vmax_new
    denom = (v_used / bc2).sqrt() + eps
    p_new = (p * (1.0 - lr * wd) if decoupled else p) - (m_new / bc1) * lr / denom
    updates = [(p, p_new), (m, m_new), (v, v_new)]
    if vmax_new is not None:
        updates.append((st["max_exp_avg_sq"], vmax_new))
    for dst, src in updates:
        dst.copy_(src if skip is None else torch.where(skip, dst, src))
