"""Every configuration torch's own optimizer test suite feeds ``torch.optim.AdamW``
(``optim_db``'s ``optim_inputs_func``: Tensor lr, weight decay, maximize, AMSGrad, ...),
for FP32, FP64, BF16 and FP16 parameters, contiguous and not (torch's
``contiguous=False`` case: ``randn(10, 5, 2)[..., 0]``), given to
``ruda_torch.AdamW(fused_step=True)`` in place of torch's ``fused=True`` and stepped side
by side with torch.optim.AdamW. The inputs that only torch's execution options take
(``foreach``, ``capturable``, ``differentiable``) are left out."""

from __future__ import annotations

import pytest
import torch
from optim_harness import VS_TORCH

import ruda_torch

common_optimizers = pytest.importorskip("torch.testing._internal.common_optimizers")
INFO = next(o for o in common_optimizers.optim_db if o.optim_cls is torch.optim.AdamW)
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TORCH_ONLY = ("foreach", "capturable", "differentiable")


def _inputs():
    out = []
    for dtype in DTYPES:
        for oi in INFO.optim_inputs_func(device="cpu", dtype=dtype):
            if any(oi.kwargs.get(k) for k in TORCH_ONLY):
                continue
            for contiguous in (True, False):
                out.append(pytest.param(dtype, oi.kwargs, contiguous,
                                        id=f"{dtype}-{oi.desc}-{'contiguous' if contiguous else 'strided'}"))  # fmt: skip
    return out


def _clone_kwargs(kwargs: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("dtype, kwargs, contiguous", _inputs())
def test_torch_optim_input_steps_like_torch(dtype, kwargs, contiguous):
    gen = torch.Generator().manual_seed(0)
    if contiguous:
        w, b = torch.randn(10, 5, generator=gen), torch.randn(10, generator=gen)
    else:  # views with gaps, in the parameters' dtype (torch's own construction)
        w = torch.randn(10, 5, 2, generator=gen).to(dtype)[..., 0]
        b = torch.randn(10, 2, generator=gen).to(dtype)[..., 0]
    ours_p = [torch.nn.Parameter(t.to(dtype)) for t in (w, b)]
    ref_p = [torch.nn.Parameter(p.detach().clone()) for p in ours_p]
    assert ours_p[0].is_contiguous() == contiguous
    theirs_kw = {k: v for k, v in _clone_kwargs(kwargs).items() if k != "fused"}
    ours_kw = {"eps": 1e-8, "weight_decay": 1e-2, **_clone_kwargs(theirs_kw)}  # torch's defaults
    ours = ruda_torch.AdamW(ours_p, fused_step=True, **ours_kw)
    theirs = torch.optim.AdamW(ref_p, **theirs_kw)
    for _ in range(5):
        for p, q in zip(ours_p, ref_p, strict=True):
            g = torch.randn(p.shape, generator=gen).to(dtype)
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for p, q in zip(ours_p, ref_p, strict=True):
        if dtype == torch.float32:
            VS_TORCH.check(p, q, "FP32 parameter")
        elif dtype == torch.float64:
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
        else:  # torch keeps 16-bit moments, ours FP32: a few 16-bit ulps apart after 5 steps
            torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-2)
