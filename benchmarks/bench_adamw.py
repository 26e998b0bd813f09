#!/usr/bin/env python3
"""Benchmark: ruda_torch's fused AdamW step against a staged baseline and torch.optim.AdamW.

Variants, each with its own copy of one materialized starting state (parameters,
gradients, moments and step counts drawn once from ``--seed``; Note [Starting state]):

  ours_fused      ruda_torch.AdamW(fused_step=True): ruda_torch.ops.adamw_scaled_, one
                  native kernel per bucket
  ours_flat       ruda_torch.AdamW(fused_step=True, flat_grads=True): the same kernel with
                  every p.grad a view of the bucket's flat gradient buffer (FP32 gradients
                  only: a flat buffer has the parameters' dtype)
  staged          the benchmark-only staged baseline on flat buffers: 4 stages (unscale,
                  moments m and v, [AMSGrad max], update), each built from tensor ops
  torch_foreach   torch.optim.AdamW(foreach=True)
  torch_fused     torch.optim.AdamW(fused=True)
  torch_pipeline  clip_grad_norm_(foreach=True) + torch.optim.AdamW(fused=True); with
                  --scaler GradScaler.unscale_ first and scaler.step/update around it
  ours_pipeline   ruda_torch.AdamW(fused_step=True, hierarchical_stats=True,
                  max_grad_norm=...); with --scaler scaler.step/update around it
  stream_add      a.add_(b) on FP32 buffers: the machine's in-place streaming rate,
                  measured in the same run (on CUDA also d2d_copy: b.copy_(a))

Every variant uses the same explicit hyperparameters (lr=1e-3, betas=(0.9, 0.999),
eps=1e-8, weight_decay=1e-2). torch.optim.AdamW needs gradients of the parameters' dtype,
so with --grad-dtype float16/bfloat16 only ours and the staged baseline run.

Method: --warmup steps per variant first; then --samples measured batches of
--iterations steps each, the order of the variants alternating (forward, reversed) from
one sample to the next. On CUDA the device is synchronized before and after every batch,
which is timed with CUDA events (the wall time is recorded too); on the CPU with
time.perf_counter. Times are per step and include everything the step does on the host
(Python, allocations, submissions). After every measured batch the parameters and
moments of all variants are compared (Note [Checks]); a divergence stops the run with
exit status 1, after writing the JSON.

Note [Traffic model]
Source-level accounting of the bytes a step must move per parameter element, not
measured DRAM traffic. A steady AdamW step with FP32 gradients reads the parameter, the
gradient and both moments and writes the parameter and both moments: 4 x 4 + 3 x 4 = 28
bytes. AMSGrad adds 8 (read and write the maximum); a 16-bit gradient saves 2; the
statistics pass of hierarchical_stats reads the gradient once more (+4 for FP32, +2 for
16-bit). clip_grad_norm_ reads the gradients for the norm and rewrites them scaled (+12
FP32), GradScaler.unscale_ rewrites them (+8). GradScaler.step on an optimizer that
takes the scale itself (ours) still runs its inf check, an in-place unscale by 1.0
(+8). The staged baseline counts 48 bytes for the steady FP32 step, its seed's figure
for 4 kernels with repeated gradient reads and a delta buffer (+12 with the AMSGrad
kernel, -2 for 16-bit gradients); the tensor ops written here move more (printed
separately). torch_foreach has no model of its own: its GB/s are at 28 bytes, i.e. the
rate a single pass would need for the same time. stream_add counts 12 bytes (a and b
read, a written), d2d_copy 8.

Note [Starting state]
All variants see the same values: one flat FP32 parameter buffer, one flat gradient
buffer (in --grad-dtype) and flat moments, every tensor of the model a slice starting on
a 16-element boundary (ruda_torch's bucket layout, so its state buffers line up with
everyone else's), padding zero. The step counts start at 10. Each variant gets its own
copy. The gradients stay the same for every step: no variant writes them except the
torch pipeline (clip_grad_norm_ and GradScaler.unscale_ multiply them in place), which
is why max_grad_norm is twice the gradients' norm and the scale is 1.0 (Note [Inactive
clipping]).

Note [Inactive clipping]
Both pipelines compute the gradient norm and multiply by the clip coefficient on every
step, whatever its value: clip_grad_norm_ always runs its multiply, and ours always
scales by the coefficient inside the kernel. With max_grad_norm above the norm the
coefficient is exactly 1, so the torch pipeline's in-place multiply (and GradScaler's
unscale by 1.0) leave the gradients unchanged, every step starts from the same
gradients, and each pipeline must match its bare step bit for bit. The work per step is
the same as with active clipping.

Note [Checks]
After every measured batch, with S the number of steps each variant has taken:
- exactly equal (torch.equal, every element of parameters and moments):
  ours_pipeline vs ours_fused, ours_flat vs ours_fused, torch_pipeline vs torch_fused;
- each FP32 implementation vs the FP64 reference (ruda_torch.reference) advanced S steps
  on a probe of elements (the first and last element of every tensor and random
  others), with the tolerance rows "chain.*" of tests/tolerances.py: its error at most 3
  times the larger of the baseline's own error (torch_fused; staged without torch) and
  the floor of Note [Long chains], in FP32 ulps of max|reference| (parameters, first
  moment) or of each element (second moments);
- every element of every variant against the baseline, within a budget derived from the
  same table (``_full_budget``).

Note [Long chains]
The table's "chain" rows are calibrated on 5 steps with a floor of 1 unit; a benchmark
takes tens of steps. Each step's own rounding costs about 1 unit (tests/tolerances.py:
docs/design.md section 1's arrangement stays within 1.1 units per step), and an error already in a
moment shrinks by its beta at every later step. So after S steps from the common
starting state the floor is sum(beta^j, j < S) units: at most 10 for the first moment
(beta1 = 0.9), about S for the second moment (beta2 = 0.999) and its maximum, and S for
the parameter. The implementations differ there in operation order: torch computes the
first moment with lerp, which keeps its error near 1 unit, design.md's arrangement
(beta1 m + (1 - beta1) g) lets it grow towards a few units; neither is a mistake.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))  # tolerances.py: the tests' tolerance table

from tolerances import FP32_EPS, FP32_TINY, TOLERANCES, assert_close_to_reference  # noqa: E402

import ruda_torch  # noqa: E402
from ruda_torch.reference import adamw_reference  # noqa: E402

LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 1e-2
HYPER = dict(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
ALIGN = 16  # elements: ruda_torch's bucket alignment (Note [Starting state])
START_STEP = 10
MANY_SMALL = (20_000, 512)
PROBE_RANDOM = 32_768
GRAD_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ALL_VARIANTS = (
    "ours_fused",
    "ours_flat",
    "staged",
    "torch_foreach",
    "torch_fused",
    "torch_pipeline",
    "ours_pipeline",
)
TORCH_VARIANTS = ("torch_foreach", "torch_fused", "torch_pipeline")
EXACT_PAIRS = (
    ("ours_pipeline", "ours_fused"),
    ("ours_flat", "ours_fused"),
    ("torch_pipeline", "torch_fused"),
)
QUANTITIES = ("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
ELEMENTWISE = {"param": False, "exp_avg": False, "exp_avg_sq": True, "max_exp_avg_sq": True}
# CPU goals of this project (informational: a miss is reported, it does not fail the run).
GOALS = {
    "fused_vs_torch_fused": 0.95,
    "pipeline_speedup": 1.5,
    "many_small_speedup": 5.0,
    "many_small_flat_speedup": 15.0,
    "fused_fraction_of_stream": 0.85,
}


class Divergence(Exception):
    """Two variants that must agree do not."""


# ------------------------------------------------------------------------- traffic model


def model_bytes(variant: str, grad_bytes: int, amsgrad: bool, scaler: bool) -> int:
    """Bytes per element of one step of ``variant`` (Note [Traffic model])."""
    step = 24 + grad_bytes + (8 if amsgrad else 0)
    if variant in ("ours_fused", "ours_flat", "torch_fused", "torch_foreach"):
        return step
    if variant == "staged":
        return 48 - (4 - grad_bytes) + (12 if amsgrad else 0)
    if variant == "torch_pipeline":
        return step + 3 * grad_bytes + (2 * grad_bytes if scaler else 0)
    if variant == "ours_pipeline":
        return step + grad_bytes + (2 * grad_bytes if scaler else 0)
    if variant == "stream_add":
        return 12
    if variant == "d2d_copy":
        return 8
    raise KeyError(variant)


def staged_written_bytes(grad_bytes: int, amsgrad: bool) -> tuple[int, int]:
    """(bytes per element, tensor ops) that ``StagedBaseline.step`` as written moves."""
    unscale = grad_bytes + 4  # torch.mul(g, factor, out=d)
    moments = 12 + 8 + 12  # m.lerp_(d), v.mul_(b2), v.addcmul_(d, d)
    amsgrad_max = 12 if amsgrad else 0  # torch.maximum(vmax, v, out=vmax)
    update = 8 + 8 + 8 + 8 + 16  # sqrt(out=d), d.div_, d.add_, p.mul_, p.addcdiv_(m, d)
    ops = 1 + 3 + (1 if amsgrad else 0) + 5
    return unscale + moments + amsgrad_max + update, ops


# ------------------------------------------------------------------------- layout, state


@dataclass
class Layout:
    sizes: list[int]
    offsets: list[int]
    total: int  # flat length, padding included

    @property
    def elements(self) -> int:
        return sum(self.sizes)


def make_layout(sizes: list[int]) -> Layout:
    offsets, total = [], 0
    for n in sizes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return Layout(sizes, offsets, total)


def split_sizes(elements: int, tensors: int) -> list[int]:
    """``elements`` split into ``tensors`` sizes that differ by at most one."""
    tensors = max(1, min(tensors, elements))
    base, extra = divmod(elements, tensors)
    return [base + (1 if i < extra else 0) for i in range(tensors)]


@dataclass
class StartState:
    layout: Layout
    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor | None
    grad_norm: float  # FP64 norm of the gradients


def make_start_state(
    layout: Layout, grad_dtype: torch.dtype, amsgrad: bool, device: torch.device, seed: int
) -> StartState:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    n = layout.total

    def normal(std: float) -> torch.Tensor:
        return torch.empty(n, device=device).normal_(0.0, std, generator=gen)

    param = normal(1.0)
    grad32 = normal(1e-3)
    exp_avg = normal(1e-3)
    exp_avg_sq = normal(1e-3).square_()
    vmax = None
    if amsgrad:
        vmax = exp_avg_sq * torch.empty(n, device=device).uniform_(1.0, 2.0, generator=gen)
    tensors = [param, grad32, exp_avg, exp_avg_sq] + ([vmax] if vmax is not None else [])
    for off, size in zip(layout.offsets, layout.sizes, strict=True):
        end = off + (-(-size // ALIGN) * ALIGN)
        if end > off + size:
            for t in tensors:
                t[off + size : end].zero_()
    grad = grad32.to(grad_dtype)
    del grad32
    grad_norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
    return StartState(layout, param, grad, exp_avg, exp_avg_sq, vmax, grad_norm)


def params_over(flat: torch.Tensor, layout: Layout) -> list[torch.nn.Parameter]:
    """Parameters that are views of ``flat`` (writes to them land in ``flat``)."""
    return [
        torch.nn.Parameter(flat[off : off + n], requires_grad=True)
        for off, n in zip(layout.offsets, layout.sizes, strict=True)
    ]


def attach_grads(params, grad_flat: torch.Tensor, layout: Layout) -> bool:
    """Set every ``p.grad`` to a view of ``grad_flat``. Returns False when the gradient
    dtype differs from the parameters' and this torch cannot attach such gradients."""
    for p, off, n in zip(params, layout.offsets, layout.sizes, strict=True):
        if grad_flat.dtype != p.dtype:
            if not hasattr(p, "grad_dtype"):
                return False
            p.grad_dtype = grad_flat.dtype
        p.grad = grad_flat[off : off + n]
    return True


# ------------------------------------------------------------------------------ variants


class Variant:
    """One way of taking the step. ``flats()`` returns flat tensors in the shared layout."""

    name = ""

    def step(self) -> None:
        raise NotImplementedError

    def flats(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _torch_state(start: StartState, layout: Layout, m, v, vmax, fused: bool, device):
    states = []
    for off, n in zip(layout.offsets, layout.sizes, strict=True):
        st = {
            # foreach (not capturable) keeps the step on the CPU, fused on the device.
            "step": torch.tensor(float(START_STEP), device=device if fused else "cpu"),
            "exp_avg": m[off : off + n],
            "exp_avg_sq": v[off : off + n],
        }
        if vmax is not None:
            st["max_exp_avg_sq"] = vmax[off : off + n]
        states.append(st)
    return states


class TorchVariant(Variant):
    def __init__(self, name: str, start: StartState, amsgrad: bool, scaler: bool):
        self.name = name
        layout = start.layout
        device = start.param.device
        self.p = start.param.clone()
        self.m = start.exp_avg.clone()
        self.v = start.exp_avg_sq.clone()
        self.vmax = start.max_exp_avg_sq.clone() if amsgrad else None
        pipeline = name == "torch_pipeline"
        # The pipeline multiplies its gradients in place: give it its own copy.
        self.g = start.grad.clone() if pipeline else start.grad
        self.params = params_over(self.p, layout)
        attach_grads(self.params, self.g, layout)
        fused = name != "torch_foreach"
        kind = dict(fused=True) if fused else dict(foreach=True)
        self.opt = torch.optim.AdamW(self.params, amsgrad=amsgrad, **HYPER, **kind)
        for p, st in zip(
            self.params,
            _torch_state(start, layout, self.m, self.v, self.vmax, fused, device),
            strict=True,
        ):
            self.opt.state[p] = st
        self.max_norm = 2.0 * start.grad_norm  # Note [Inactive clipping]
        self.pipeline = pipeline
        self.scaler = _grad_scaler(device) if (pipeline and scaler) else None

    def step(self) -> None:
        if not self.pipeline:
            self.opt.step()
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.opt)
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        _optimizer_step(self.opt, self.scaler)

    def flats(self):
        return {
            "param": self.p,
            "exp_avg": self.m,
            "exp_avg_sq": self.v,
            "max_exp_avg_sq": self.vmax,
        }


def _optimizer_step(opt: torch.optim.Optimizer, scaler) -> None:
    """opt.step(), through GradScaler's step and update when the variant has a scaler."""
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


def _grad_scaler(device: torch.device):
    # Scale 1.0: the in-place unscale leaves the gradients unchanged (Note [Inactive
    # clipping]); the kernels do the same work for any scale. No growth during the run.
    scaler = torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=2**30)
    # Training calls scaler.scale(loss) before backward, which creates the scale tensor;
    # here there is no loss: scale a dummy once.
    scaler.scale(torch.ones((), device=device))
    return scaler


class OursVariant(Variant):
    """ruda_torch.AdamW(fused_step=True), bare, with flat gradients or as the full
    pipeline."""

    def __init__(self, name: str, start: StartState, amsgrad: bool, scaler: bool):
        self.name = name
        layout = self.layout = start.layout
        self.p = start.param.clone()
        pipeline = name == "ours_pipeline"
        flat = name == "ours_flat"
        if flat and start.grad.dtype != start.param.dtype:
            raise _Unsupported("flat gradients have the parameters' dtype (FP32)")
        # Ours never writes the gradients, but GradScaler.step's inf check rewrites them
        # (by 1.0): with a scaler the pipeline gets its own copy.
        self.g = start.grad.clone() if (pipeline and scaler) else start.grad
        self.params = params_over(self.p, layout)
        if not attach_grads(self.params, self.g, layout):
            raise _Unsupported(
                f"torch {torch.__version__} cannot attach {self.g.dtype} gradients to FP32 "
                "parameters (no Tensor.grad_dtype)"
            )
        extra = {}
        if pipeline:
            extra = dict(hierarchical_stats=True, max_grad_norm=2.0 * start.grad_norm)
        if flat:  # construction copies the attached gradients into the flat buffer
            extra = dict(flat_grads=True)
        self.opt = ruda_torch.AdamW(self.params, amsgrad=amsgrad, fused_step=True, **HYPER, **extra)
        for p, off, n in zip(self.params, layout.offsets, layout.sizes, strict=True):
            st = {
                "step": torch.tensor(float(START_STEP)),
                "exp_avg": start.exp_avg[off : off + n],
                "exp_avg_sq": start.exp_avg_sq[off : off + n],
            }
            if amsgrad:
                st["max_exp_avg_sq"] = start.max_exp_avg_sq[off : off + n]
            self.opt.state[p] = st  # copied into the bucket at the first step
        self.pipeline = pipeline
        self.scaler = _grad_scaler(self.p.device) if (pipeline and scaler) else None

    def step(self) -> None:
        _optimizer_step(self.opt, self.scaler)

    def flats(self):
        out = {"param": self.p}
        for key in QUANTITIES[1:]:
            if key in self.opt.state[self.params[0]]:
                out[key] = _bucket_flat(self.opt, self.params, self.layout, key)
            else:
                out[key] = None
        return out


class _Unsupported(Exception):
    pass


def _bucket_flat(opt, params, layout: Layout, key: str) -> torch.Tensor:
    """The flat buffer behind ruda_torch's state views when its layout is the shared one
    (it is: 16-element aligned slices in parameter order); otherwise a gathered copy."""
    views = [opt.state[p][key] for p in params]
    base = views[0]._base
    if (
        base is not None
        and base.dim() == 1
        and base.numel() == layout.total
        and all(v._base is base for v in views)
        and all(
            v.storage_offset() - base.storage_offset() == off
            for v, off in zip(views, layout.offsets, strict=True)
        )
    ):
        return base
    out = torch.zeros(layout.total, dtype=torch.float32, device=views[0].device)
    for v, off, n in zip(views, layout.offsets, layout.sizes, strict=True):
        out[off : off + n].copy_(v.reshape(-1))
    return out


class OursOpVariant(Variant):
    """ruda_torch.ops.adamw_scaled_ called directly on flat buffers: ours with 16-bit
    gradients on a torch that cannot attach them to FP32 parameters."""

    name = "ours_fused"

    def __init__(self, start: StartState, amsgrad: bool):
        layout = start.layout
        self.p = start.param.clone()
        self.m = start.exp_avg.clone()
        self.v = start.exp_avg_sq.clone()
        self.vmax = start.max_exp_avg_sq.clone() if amsgrad else None
        self.params = [
            self.p[off : off + n] for off, n in zip(layout.offsets, layout.sizes, strict=True)
        ]
        self.grads = [
            start.grad[off : off + n] for off, n in zip(layout.offsets, layout.sizes, strict=True)
        ]
        device = self.p.device
        self.steps = torch.full((len(self.params),), float(START_STEP), device=device)
        self.slots = torch.tensor(
            [[off, i] for i, off in enumerate(layout.offsets)], dtype=torch.int64
        ).reshape(-1, 2)

    def step(self) -> None:
        ruda_torch.ops.adamw_scaled_(
            self.params, self.grads, self.m, self.v, self.vmax, self.steps, self.slots,
            lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
        )  # fmt: skip

    def flats(self):
        return {
            "param": self.p,
            "exp_avg": self.m,
            "exp_avg_sq": self.v,
            "max_exp_avg_sq": self.vmax,
        }


class StagedBaseline(Variant):
    """The staged baseline: separate tensor ops on flat buffers, in 4 stages (5 with
    AMSGrad), each reading what the previous one wrote. The host keeps the step count.

    1. unscale   d = g * factor                     (FP32 delta buffer d)
    2. moments   m = lerp(m, d, 1 - beta1); v = beta2 v + (1 - beta2) d^2
    3. AMSGrad   vmax = max(vmax, v)
    4. update    d = sqrt(v_used) / sqrt(1 - beta2^t) + eps
                 p = p (1 - lr wd) - lr / (1 - beta1^t) * m / d
    """

    name = "staged"

    def __init__(self, start: StartState, amsgrad: bool):
        device = start.param.device
        self.p = start.param.clone()
        self.g = start.grad
        self.m = start.exp_avg.clone()
        self.v = start.exp_avg_sq.clone()
        self.vmax = start.max_exp_avg_sq.clone() if amsgrad else None
        self.d = torch.empty_like(self.p)
        # A 1-element FP32 tensor (not 0-dim) so that 16-bit gradients are promoted and
        # multiplied in FP32.
        self.factor = torch.ones(1, dtype=torch.float32, device=device)
        self.t = START_STEP

    def step(self) -> None:
        self.t += 1
        b1, b2 = BETAS
        bc1 = 1.0 - b1**self.t
        bc2_sqrt = math.sqrt(1.0 - b2**self.t)
        d, m, v = self.d, self.m, self.v
        torch.mul(self.g, self.factor, out=d)  # stage 1: unscale
        m.lerp_(d, 1.0 - b1)  # stage 2: moments
        v.mul_(b2).addcmul_(d, d, value=1.0 - b2)
        v_used = v
        if self.vmax is not None:  # stage 3: AMSGrad maximum
            torch.maximum(self.vmax, v, out=self.vmax)
            v_used = self.vmax
        torch.sqrt(v_used, out=d)  # stage 4: update
        d.div_(bc2_sqrt).add_(EPS)
        self.p.mul_(1.0 - LR * WEIGHT_DECAY).addcdiv_(m, d, value=-LR / bc1)

    def flats(self):
        return {
            "param": self.p,
            "exp_avg": self.m,
            "exp_avg_sq": self.v,
            "max_exp_avg_sq": self.vmax,
        }


class StreamVariant(Variant):
    """The streaming-rate reference: ``a.add_(b)`` (or ``b.copy_(a)``) on FP32 buffers
    of the benchmark's element count."""

    def __init__(self, name: str, elements: int, device: torch.device):
        self.name = name
        self.a = torch.full((elements,), 1.0, device=device)
        self.b = torch.full((elements,), 1e-3, device=device)

    def step(self) -> None:
        if self.name == "stream_add":
            self.a.add_(self.b)
        else:
            self.b.copy_(self.a)

    def flats(self):
        return {}


# ---------------------------------------------------------------------------------- checks


class Checker:
    """Note [Checks]: the FP64 reference on a probe, exact pairs, full-tensor budgets."""

    def __init__(self, start: StartState, amsgrad: bool, seed: int):
        layout = start.layout
        device = start.param.device
        firsts = torch.tensor(layout.offsets, dtype=torch.int64)
        lasts = firsts + torch.tensor(layout.sizes, dtype=torch.int64) - 1
        gen = torch.Generator().manual_seed(seed + 1)
        # Random probes: random tensors, random positions inside them (no padding).
        k = PROBE_RANDOM
        which = torch.randint(len(layout.sizes), (k,), generator=gen)
        sizes = torch.tensor(layout.sizes, dtype=torch.int64)
        pos = (torch.rand(k, generator=gen, dtype=torch.float64) * sizes[which]).long()
        rand = firsts[which] + pos.clamp(max=sizes[which] - 1)
        idx = torch.unique(torch.cat([firsts, lasts, rand]))
        self.idx_cpu = idx
        self.idx = idx.to(device)
        take = lambda t: None if t is None else t.index_select(0, self.idx).cpu()  # noqa: E731
        self.grad = take(start.grad)
        self.ref = {
            "param": take(start.param).double(),
            "exp_avg": take(start.exp_avg).double(),
            "exp_avg_sq": take(start.exp_avg_sq).double(),
            "max_exp_avg_sq": take(start.max_exp_avg_sq).double() if amsgrad else None,
        }
        self.ref_steps = START_STEP
        self.amsgrad = amsgrad
        self.history: list[dict] = []
        self.scratch = None

    def _scratch(self, like: torch.Tensor):
        if self.scratch is None or self.scratch[0].shape != like.shape:
            self.scratch = (torch.empty_like(like), torch.empty_like(like))
        return self.scratch

    def _advance(self, steps: int) -> None:
        while self.ref_steps < steps:
            r = self.ref
            p, m, v, vmax, _ = adamw_reference(
                r["param"], self.grad, r["exp_avg"], r["exp_avg_sq"], r["max_exp_avg_sq"],
                self.ref_steps, amsgrad=self.amsgrad, **HYPER,
            )  # fmt: skip
            self.ref = {"param": p, "exp_avg": m, "exp_avg_sq": v, "max_exp_avg_sq": vmax}
            self.ref_steps += 1

    def check(self, variants: list[Variant], steps: int, baseline: str) -> dict:
        """Raise Divergence, or return the worst errors (FP32 ulp units) of this batch."""
        self._advance(steps)
        flats = {v.name: v.flats() for v in variants}
        record = {"steps": steps, "baseline": baseline, "probe_elements": int(self.idx.numel())}
        # 1. Exact pairs.
        exact = {}
        for a, b in EXACT_PAIRS:
            if a in flats and b in flats:
                for q in QUANTITIES:
                    x, y = flats[a][q], flats[b][q]
                    if x is None:
                        continue
                    if not torch.equal(x, y):
                        diff = (x - y).abs()
                        worst = int(diff.argmax())
                        raise Divergence(
                            f"{a} and {b} must be bitwise equal after {steps} steps but "
                            f"{q} differs at {int((diff != 0).sum())} elements; element "
                            f"{worst}: {x[worst].item()!r} vs {y[worst].item()!r}"
                        )
                exact[f"{a}=={b}"] = True
        record["exact"] = exact
        # 2. The probe against FP64, tolerance tied to the baseline's error.
        chain = steps - START_STEP
        probe_err: dict[str, dict[str, float]] = {}
        ratios: dict[str, float] = {}
        base = flats[baseline]
        for q in QUANTITIES:
            ref = self.ref[q]
            if ref is None:
                continue
            base_vals = base[q].index_select(0, self.idx).cpu()
            row = TOLERANCES[f"chain.{q}"]
            floor = chain_floor(q, chain)
            base_err = _error_units(base_vals.double(), ref, ELEMENTWISE[q])
            bound = row.factor * max(base_err, floor)
            for name, fl in flats.items():
                vals = fl[q].index_select(0, self.idx).cpu()
                err = _error_units(vals.double(), ref, ELEMENTWISE[q])
                probe_err.setdefault(name, {})[q] = err
                if name == baseline:
                    continue
                ratios[f"{name}.{q}"] = err / bound
                try:
                    assert_close_to_reference(
                        vals, ref, base_vals, factor=row.factor, floor=floor,
                        elementwise=ELEMENTWISE[q], what=f"{name} {q} (probe, step {steps})",
                    )  # fmt: skip
                except AssertionError as e:
                    raise Divergence(f"{name} vs FP64 reference: {e}") from None
        record["probe_error_units"] = probe_err
        record["probe_error_over_bound"] = ratios
        # 3. Every element against the baseline.
        full = {}
        for q in QUANTITIES:
            if base[q] is None:
                continue
            budget = _full_budget(q, probe_err[baseline][q], chain)
            for name, fl in flats.items():
                if name == baseline or any(
                    name in pair and baseline in pair for pair in EXACT_PAIRS
                ):
                    continue
                err = _error_units_t(fl[q], base[q], ELEMENTWISE[q], self._scratch(base[q]))
                full.setdefault(name, {})[q] = err
                ratios[f"full:{name}.{q}"] = err / budget
                if not math.isfinite(err) or err > budget:
                    raise Divergence(
                        f"{name} vs {baseline}: {q} differs by {err:.4g} units (FP32 eps x "
                        f"{'|value|' if ELEMENTWISE[q] else 'max|value|'}) after {steps} "
                        f"steps, budget {budget:.4g}"
                    )
        record["full_error_units_vs_baseline"] = full
        self.history.append(record)
        return record


def _error_units(values: torch.Tensor, ref: torch.Tensor, elementwise: bool) -> float:
    if ref.numel() == 0:
        return 0.0
    if elementwise:
        scale = ref.abs().clamp(min=FP32_TINY)
    else:
        scale = max(ref.abs().max().item(), FP32_TINY)
    return ((values - ref).abs() / (FP32_EPS * scale)).max().item()


def _error_units_t(a: torch.Tensor, b: torch.Tensor, elementwise: bool, scratch) -> float:
    """Like _error_units, on the device and in FP32, for full buffers; ``scratch`` holds
    two FP32 buffers of their size (no allocation per comparison)."""
    diff, scale = scratch
    torch.sub(a, b, out=diff).abs_()
    if elementwise:
        torch.abs(b, out=scale).clamp_(min=FP32_TINY)
        return diff.div_(scale).max().item() / FP32_EPS
    largest = max(torch.abs(b, out=scale).max().item(), FP32_TINY)
    return diff.max().item() / (FP32_EPS * largest)


def chain_floor(q: str, chain: int) -> float:
    """Note [Long chains]: the error floor, in FP32 ulp units, after ``chain`` steps."""
    beta = {"exp_avg": BETAS[0], "exp_avg_sq": BETAS[1], "max_exp_avg_sq": BETAS[1]}.get(q, 1.0)
    damped = chain if beta == 1.0 else (1.0 - beta**chain) / (1.0 - beta)
    return max(TOLERANCES[f"chain.{q}"].floor, damped)


def _full_budget(q: str, baseline_probe_err: float, chain: int) -> float:
    """Budget of |variant - baseline| over every element, in FP32 ulp units.

    By the triangle inequality an implementation within ``factor x max(err, floor)`` of
    the reference is within ``(factor + 1) x max(err, floor)`` of the baseline
    (tests/tolerances.py). The probe sees only part of the elements, and the largest
    error over all elements is larger than over the probe: a second factor of 2 covers
    that. Kernel mistakes (a skipped tensor, a wrong offset or step count) cost
    thousands of units and more."""
    row = TOLERANCES[f"chain.{q}"]
    return 2.0 * (row.factor + 1.0) * max(baseline_probe_err, chain_floor(q, chain))


# ----------------------------------------------------------------------------- measuring


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def batch(self, fn, iterations: int) -> tuple[float, float]:
        """(ms per step by CUDA events or perf_counter, wall ms per step)."""
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for _ in range(iterations):
                fn()
            end.record()
            end.synchronize()
            wall = (time.perf_counter() - t0) * 1e3 / iterations
            return start.elapsed_time(end) / iterations, wall
        t0 = time.perf_counter()
        for _ in range(iterations):
            fn()
        wall = (time.perf_counter() - t0) * 1e3 / iterations
        return wall, wall


def count_syncs(fn) -> tuple[int, list[str]]:
    """Host synchronizations of one call, counted by torch.cuda.set_sync_debug_mode."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    msgs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    return len(msgs), msgs[:5]


@dataclass
class Case:
    name: str
    sizes: list[int]
    variants: list[str]
    notes: list[str] = field(default_factory=list)


def run_case(case: Case, args, device: torch.device, grad_dtype: torch.dtype) -> dict:
    layout = make_layout(case.sizes)
    n = layout.elements
    grad_bytes = torch.empty((), dtype=grad_dtype).element_size()
    print(
        f"\n== {case.name}: {n:,} elements in {len(case.sizes):,} tensors, grads "
        f"{args.grad_dtype}{', AMSGrad' if args.amsgrad else ''}"
        f"{', GradScaler' if args.scaler else ''} on {device}",
        flush=True,
    )
    for note in case.notes:
        print(f"   note: {note}")
    t0 = time.perf_counter()
    start = make_start_state(layout, grad_dtype, args.amsgrad, device, args.seed)
    variants: list[Variant] = []
    skipped = {}
    for name in case.variants:
        try:
            if name == "staged":
                variants.append(StagedBaseline(start, args.amsgrad))
            elif name == "ours_flat":
                variants.append(OursVariant(name, start, args.amsgrad, args.scaler))
            elif name in ("ours_fused", "ours_pipeline"):
                try:
                    variants.append(OursVariant(name, start, args.amsgrad, args.scaler))
                except _Unsupported as e:
                    if name == "ours_pipeline":
                        raise
                    print(f"   ours_fused: {e}; calling ruda_torch.ops.adamw_scaled_ directly")
                    variants.append(OursOpVariant(start, args.amsgrad))
            else:
                variants.append(TorchVariant(name, start, args.amsgrad, args.scaler))
        except _Unsupported as e:
            skipped[name] = str(e)
            print(f"   skipped {name}: {e}")
    stream_names = ["stream_add"] + (["d2d_copy"] if device.type == "cuda" else [])
    streams = [StreamVariant(s, n, device) for s in stream_names]
    checker = Checker(start, args.amsgrad, args.seed)
    baseline = "torch_fused" if any(v.name == "torch_fused" for v in variants) else "staged"
    if not any(v.name == baseline for v in variants):
        baseline = variants[0].name
    grad_norm = start.grad_norm
    del start  # the variants hold what they need of it
    setup_s = time.perf_counter() - t0
    timer = Timer(device)

    # Warm-up (also builds ruda_torch's buckets and torch's state on the first step).
    t0 = time.perf_counter()
    for v in variants + streams:
        for _ in range(args.warmup):
            v.step()
    timer.sync()
    steps = START_STEP + args.warmup
    checker.check(variants, steps, baseline)
    warmup_s = time.perf_counter() - t0

    times: dict[str, list[float]] = {v.name: [] for v in variants + streams}
    walls: dict[str, list[float]] = {v.name: [] for v in variants + streams}
    order = variants + streams
    t0 = time.perf_counter()
    divergence = None
    for s in range(args.samples):
        gc.collect()
        gc.disable()
        try:
            for v in order if s % 2 == 0 else list(reversed(order)):
                ms, wall = timer.batch(v.step, args.iterations)
                times[v.name].append(ms)
                walls[v.name].append(wall)
        finally:
            gc.enable()
        steps += args.iterations
        try:
            rec = checker.check(variants, steps, baseline)
        except Divergence as e:
            divergence = str(e)
            print(f"   DIVERGENCE after sample {s + 1}: {e}", flush=True)
            break
        worst = max(rec["probe_error_over_bound"].items(), key=lambda kv: kv[1], default=None)
        print(
            f"   sample {s + 1}/{args.samples}: checked at step {steps}: exact pairs equal"
            + (f"; largest error/bound {worst[1]:.2f} ({worst[0]})" if worst else ""),
            flush=True,
        )
    measure_s = time.perf_counter() - t0

    syncs = {}
    if device.type == "cuda" and args.count_syncs and divergence is None:
        for v in variants:
            syncs[v.name] = dict(zip(("count", "messages"), count_syncs(v.step), strict=True))

    stream_rate = None
    results = {}
    for name, ts in times.items():
        if not ts:
            continue
        med = statistics.median(ts)
        mb = model_bytes(name, grad_bytes, args.amsgrad, args.scaler)
        gbps = mb * n / (med * 1e-3) / 1e9
        results[name] = {
            "ms_per_step": ts,
            "median_ms": med,
            "min_ms": min(ts),
            "max_ms": max(ts),
            "wall_ms_per_step": walls[name],
            "model_bytes_per_element": mb,
            "model_gb_per_step": mb * n / 1e9,
            "gbps": gbps,
        }
        if name == "stream_add":
            stream_rate = gbps
    for r in results.values():
        r["fraction_of_stream_add"] = r["gbps"] / stream_rate if stream_rate else None
    if "d2d_copy" in results:
        for r in results.values():
            r["fraction_of_d2d_copy"] = r["gbps"] / results["d2d_copy"]["gbps"]
    if "staged" in results:
        written, ops = staged_written_bytes(grad_bytes, args.amsgrad)
        r = results["staged"]
        r["written_bytes_per_element"] = written
        r["written_tensor_ops"] = ops
        r["written_gbps"] = written * n / (r["median_ms"] * 1e-3) / 1e9
    for name, info in syncs.items():
        results[name]["host_syncs_per_step"] = info["count"]
        results[name]["host_sync_messages"] = info["messages"]

    ratios: dict[str, float] = {}
    best: dict[str, float] = {}

    def ratio(key, num, den):
        # Medians, and (in "best") the fastest batches: on a shared, noisy machine the
        # best batch is the one least disturbed by other work.
        if num in results and den in results:
            ratios[key] = results[num]["median_ms"] / results[den]["median_ms"]
            best[key] = results[num]["min_ms"] / results[den]["min_ms"]

    ratio("fused_vs_torch_fused", "torch_fused", "ours_fused")
    ratio("flat_vs_torch_fused", "torch_fused", "ours_flat")
    ratio("pipeline_speedup", "torch_pipeline", "ours_pipeline")
    ratio("fused_vs_staged", "staged", "ours_fused")
    ratio("fused_vs_torch_foreach", "torch_foreach", "ours_fused")
    if "ours_fused" in results and results["ours_fused"].get("fraction_of_stream_add"):
        ratios["fused_fraction_of_stream"] = results["ours_fused"]["fraction_of_stream_add"]
        best["fused_fraction_of_stream"] = (
            results["stream_add"]["min_ms"] / results["ours_fused"]["min_ms"]
        ) * (results["ours_fused"]["model_bytes_per_element"] / 12)
    # What any exact two-pass pipeline could reach here: moving ours_pipeline's bytes at
    # the fastest streaming rate this run measured (stream_add or our own fused step).
    # Clipping needs the global norm before the first update, so every gradient is read
    # once for the statistics and once for the step; a goal above this bound asks for
    # more than the memory system gives.
    if {"torch_pipeline", "ours_pipeline"} <= results.keys():
        fast = [results[k] for k in ("stream_add", "ours_fused") if k in results]
        need = results["ours_pipeline"]["model_gb_per_step"]
        for stat, into in (("median_ms", ratios), ("min_ms", best)):
            if fast:
                rate = max(r["model_gb_per_step"] / r[stat] for r in fast)  # GB per ms
                into["pipeline_speedup_bound"] = results["torch_pipeline"][stat] / (need / rate)
    if "ours_fused" in results and "fraction_of_d2d_copy" in results["ours_fused"]:
        ratios["fused_fraction_of_d2d_copy"] = results["ours_fused"]["fraction_of_d2d_copy"]

    report = None
    for v in variants:
        if v.name == "ours_pipeline":
            t = v.opt.last_report.tensor.double().cpu()
            report = {
                "grad_norm": math.sqrt(t[0].item()),
                "max_abs": t[1].item(),
                "nonfinite_count": t[2].item(),
                # The statistics pass must see the same gradients as the FP64 norm.
                "grad_norm_fp64": grad_norm,
                "norm_relative_error": abs(math.sqrt(t[0].item()) - grad_norm) / grad_norm,
            }
    out = {
        "case": case.name,
        "elements": n,
        "tensors": len(case.sizes),
        "flat_elements_with_padding": layout.total,
        "grad_dtype": args.grad_dtype,
        "amsgrad": args.amsgrad,
        "scaler": args.scaler,
        "variants_skipped": skipped,
        "notes": case.notes,
        "baseline_for_checks": baseline,
        "results": results,
        "ratios": ratios,
        "ratios_of_min": best,
        "ours_pipeline_report": report,
        "checks": checker.history,
        "divergence": divergence,
        "seconds": {"setup": setup_s, "warmup": warmup_s, "measure": measure_s},
    }
    for v in variants + streams:
        v.close()
    del variants, streams
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print_case(out)
    return out


# ------------------------------------------------------------------------------- output


def print_case(out: dict) -> None:
    res = out["results"]
    has_d2d = any("fraction_of_d2d_copy" in r for r in res.values())
    has_syncs = any("host_syncs_per_step" in r for r in res.values())
    head = f"   {'variant':<15} {'median ms':>10} {'min':>9} {'max':>9} {'B/el':>5} {'GB/s':>7} {'%add_':>6}"
    if has_d2d:
        head += f" {'%copy':>6}"
    if has_syncs:
        head += f" {'syncs':>5}"
    print(head)
    for name, r in res.items():
        frac = r.get("fraction_of_stream_add")
        line = (
            f"   {name:<15} {r['median_ms']:>10.3f} {r['min_ms']:>9.3f} {r['max_ms']:>9.3f} "
            f"{r['model_bytes_per_element']:>5} {r['gbps']:>7.1f} "
            f"{(100 * frac if frac else float('nan')):>5.0f}%"
        )
        if has_d2d:
            line += f" {100 * r.get('fraction_of_d2d_copy', float('nan')):>5.0f}%"
        if has_syncs:
            line += f" {r.get('host_syncs_per_step', ''):>5}"
        print(line)
    if "staged" in res:
        r = res["staged"]
        print(
            f"   staged as written: {r['written_tensor_ops']} tensor ops, "
            f"{r['written_bytes_per_element']} B/element, {r['written_gbps']:.1f} GB/s "
            "(the table uses the seed's 4-kernel model)"
        )
    if "torch_foreach" in res:
        print("   torch_foreach GB/s at 28 B/element (effective; it makes several passes)")
    print(f"   {'ratio (> 1: ours faster)':<28} {'medians':>8} {'fastest':>8}")
    for key, value in out["ratios"].items():
        b = out["ratios_of_min"].get(key)
        print(f"   {key:<28} {value:>8.3f} {b if b is not None else float('nan'):>8.3f}")
    rep = out.get("ours_pipeline_report")
    if rep:
        print(
            f"   ours_pipeline report: gradient norm {rep['grad_norm']:.6g} (relative error "
            f"vs FP64 {rep['norm_relative_error']:.2g}), nonfinite "
            f"{rep['nonfinite_count']:.0f}"
        )


def print_summary(cases: list[dict], device: torch.device) -> dict:
    """Headline ratios; on the CPU also whether the project's goals are met, where the
    run has the goals' configuration (FP32 gradients, no AMSGrad or GradScaler, at least
    50M elements in 200 tensors; the many-small case as defined)."""
    summary = {}
    fastest = {}
    main = [c for c in cases if c["case"] != "many_small"]
    big = max(main, key=lambda c: c["elements"]) if main else None
    if big is not None:
        for key in ("fused_vs_torch_fused", "pipeline_speedup", "pipeline_speedup_bound",
                    "fused_fraction_of_stream"):  # fmt: skip
            if key in big["ratios"]:
                summary[key] = big["ratios"][key]
                fastest[key] = big["ratios_of_min"].get(key)
        if "fused_fraction_of_d2d_copy" in big["ratios"]:
            summary["fused_fraction_of_d2d_copy"] = big["ratios"]["fused_fraction_of_d2d_copy"]
        summary["at_elements"] = big["elements"]
    many = [c for c in cases if c["case"] == "many_small"]
    if many and "fused_vs_torch_fused" in many[0]["ratios"]:
        summary["many_small_speedup"] = many[0]["ratios"]["fused_vs_torch_fused"]
        fastest["many_small_speedup"] = many[0]["ratios_of_min"].get("fused_vs_torch_fused")
    if many and "flat_vs_torch_fused" in many[0]["ratios"]:
        summary["many_small_flat_speedup"] = many[0]["ratios"]["flat_vs_torch_fused"]
        fastest["many_small_flat_speedup"] = many[0]["ratios_of_min"].get("flat_vs_torch_fused")

    def plain(c) -> bool:
        return c["grad_dtype"] == "float32" and not c["amsgrad"] and not c["scaler"]

    judged = {}
    if device.type == "cpu":
        if (
            big is not None
            and plain(big)
            and big["elements"] >= 50_000_000
            and big["tensors"] == 200
        ):
            judged.update(dict.fromkeys(("fused_vs_torch_fused", "pipeline_speedup",
                                         "fused_fraction_of_stream"), True))  # fmt: skip
        if many and plain(many[0]):
            judged["many_small_speedup"] = True
            judged["many_small_flat_speedup"] = True
    print("\n== summary (ratios > 1: ours faster; medians, and the fastest batches)")
    for key, value in summary.items():
        if key == "at_elements":
            continue
        best = fastest.get(key)
        shown = f"{value:8.3f} {best if best is not None else float('nan'):8.3f}"
        goal = GOALS.get(key)
        verdict = ""
        if goal is not None and device.type == "cpu":
            if judged.get(key):
                verdict = f"  goal >= {goal} (medians): {'met' if value >= goal else 'MISSED'}"
            else:
                verdict = f"  (goal >= {goal} is for the goals' configuration; not judged)"
        print(f"   {key:<28} {shown}{verdict}")
    summary["fastest_batches"] = fastest
    summary["goals_judged"] = {k: bool(summary[k] >= GOALS[k]) for k in judged if k in summary}
    return summary


# --------------------------------------------------------------------------- environment


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _loadavg() -> list[str] | None:
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[:3]
    except OSError:
        return None


def _busy(loadavg) -> str | None:
    """A description of a 1-minute load average above half the CPUs, or None."""
    if not loadavg:
        return None
    load, cpus = float(loadavg[0]), os.cpu_count() or 1
    return f"load average {load} on {cpus} CPUs" if load > 0.5 * cpus else None


def _script_name() -> str:
    """This script's path relative to the repository (no machine paths in the record)."""
    return Path(__file__).resolve().relative_to(REPO_ROOT).as_posix()


def environment(device: torch.device) -> dict:
    env: dict = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "ruda_torch": ruda_torch.__version__,
        "ruda_torch_compiled_backends": list(ruda_torch.compiled_backends()),
        "ruda_torch_cpu_isa": ruda_torch._build.CPU_ISA,
        # torch's own CPU kernels (ATEN_CPU_CAPABILITY=avx2 makes an AVX-512 machine run
        # its AVX2 ones, to compare with an AVX2 build of ours)
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        m = re.search(r"^model name\s*:\s*(.*)$", info, re.M)
        env["cpu_model"] = m.group(1).strip() if m else None
        flags = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
        have = set(flags.group(1).split()) if flags else set()
        env["cpu_flags"] = sorted(have & {"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw"})
    except OSError:
        env["cpu_model"] = platform.processor() or None
    try:
        env["affinity_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        with open("/proc/meminfo") as f:
            mem = dict(line.split(":", 1) for line in f if ":" in line)
        env["mem_total"] = mem.get("MemTotal", "").strip()
        env["mem_available"] = mem.get("MemAvailable", "").strip()
    except OSError:
        pass
    env["loadavg"] = _loadavg()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_name"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["gpu_sm_count"] = props.multi_processor_count
        env["gpu_capability"] = f"{props.major}.{props.minor}"
    smi = _run(
        [
            "nvidia-smi",
            "--query-gpu=name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,"
            "clocks.max.mem,power.draw,power.limit,temperature.gpu,utilization.gpu,"
            "memory.used,memory.total,compute_mode",
            "--format=csv",
        ]
    )
    if not smi:  # an older driver may reject a field: the essentials alone
        smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm", "--format=csv"])
    if smi:
        env["nvidia_smi"] = smi.splitlines()
    return env


# ----------------------------------------------------------------------------------- main


def parse_elements(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip().replace("_", "")
        if not item:
            continue
        mult = 1
        if item[-1].upper() in "KMG":
            mult = {"K": 10**3, "M": 10**6, "G": 10**9}[item[-1].upper()]
            item = item[:-1]
        value = float(item) * mult
        if value < 1 or value != int(value):
            raise argparse.ArgumentTypeError(f"bad element count {item!r}")
        out.append(int(value))
    if not out:
        raise argparse.ArgumentTypeError("--elements needs at least one count")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--elements",
        type=parse_elements,
        default=[50_000_000],
        help="total parameter elements; a comma list (1e6,1e7 or 5M,50M) sweeps sizes",
    )
    p.add_argument(
        "--tensors", type=int, default=200, help="parameters the elements are split into"
    )
    p.add_argument("--grad-dtype", choices=sorted(GRAD_DTYPES), default="float32")
    p.add_argument("--amsgrad", action="store_true")
    p.add_argument("--scaler", action="store_true", help="pipelines with torch.amp.GradScaler")
    p.add_argument("--iterations", type=int, default=5, help="steps per measured batch")
    p.add_argument("--samples", type=int, default=5, help="measured batches per variant")
    p.add_argument("--warmup", type=int, default=3, help="steps per variant before measuring")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument(
        "--many-small",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"also run the {MANY_SMALL[0]:,} x {MANY_SMALL[1]}-element case",
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"comma list of variants to run (default: all of {','.join(ALL_VARIANTS)}; "
        "stream_add always runs)",
    )
    p.add_argument(
        "--count-syncs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, count host syncs of one step per variant (set_sync_debug_mode)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-spread",
        type=float,
        default=1.5,
        help="flag a variant whose slowest batch took more than this times its fastest",
    )
    p.add_argument("--json", type=Path, default=None, help="write all numbers here")
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="PNG of the achieved GB/s per case and variant (needs matplotlib)",
    )
    args = p.parse_args(argv)
    for name in ("iterations", "samples", "tensors"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be non-negative")
    variants = (
        list(ALL_VARIANTS)
        if args.variants is None
        else [v.strip() for v in args.variants.split(",") if v.strip()]
    )
    unknown = sorted(set(variants) - set(ALL_VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(ALL_VARIANTS)}")
    args.variant_list = [v for v in ALL_VARIANTS if v in variants]
    return args


def make_plot(path: Path, cases: list[dict]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot: matplotlib is not installed; skipped {path}")
        return
    names = sorted({n for c in cases for n in c["results"]}, key=lambda n: (n.startswith("s"), n))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(cases) * len(names) / 3), 4.5))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        xs, ys = [], []
        for i, c in enumerate(cases):
            if name in c["results"]:
                xs.append(i + j * width)
                ys.append(c["results"][name]["gbps"])
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"{c['case']}\n{c['elements']:,} el" for c in cases])
    ax.set_ylabel("GB/s (traffic model)")
    ax.set_title("AdamW step: achieved bandwidth under the traffic model")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
            return 2
        if "cuda" not in ruda_torch.compiled_backends():
            print(
                "--device cuda: this ruda_torch build has no CUDA kernels; rebuild with RUDA_TORCH_CUDA=1"
            )
            return 2
    grad_dtype = GRAD_DTYPES[args.grad_dtype]
    variants = list(args.variant_list)
    notes = []
    if grad_dtype != torch.float32:
        dropped = [v for v in variants if v in TORCH_VARIANTS]
        variants = [v for v in variants if v not in TORCH_VARIANTS]
        if dropped:
            notes.append(
                f"gradients are {args.grad_dtype}: torch.optim.AdamW needs gradients of the "
                f"parameters' dtype (float32), so {', '.join(dropped)} do not run; only ours "
                "vs the staged baseline is compared"
            )
    env = environment(device)
    print(
        f"bench_adamw: torch {env['torch']} (CUDA {env['torch_cuda']}), {env['torch_threads']} "
        f"threads, CPU {env.get('cpu_model')}, ruda_torch backends "
        f"{','.join(env['ruda_torch_compiled_backends'])} (CPU ISA {env['ruda_torch_cpu_isa']})"
        + (f", GPU {env.get('gpu_name')}" if device.type == "cuda" else "")
    )
    print(
        f"hyperparameters: lr={LR}, betas={BETAS}, eps={EPS}, weight_decay={WEIGHT_DECAY}, "
        f"amsgrad={args.amsgrad}; {args.warmup} warm-up steps, {args.samples} samples x "
        f"{args.iterations} steps, alternating order"
    )
    cases = [
        Case(f"sizes_{n}", split_sizes(n, args.tensors), variants, list(notes))
        for n in args.elements
    ]
    if args.many_small:
        ms_variants = list(variants)
        ms_notes = list(notes)
        if device.type == "cpu" and "torch_foreach" in ms_variants and args.variants is None:
            ms_variants.remove("torch_foreach")
            ms_notes.append(
                "torch_foreach is left out of this case on the CPU (seconds per step: CPU "
                "foreach ops loop over the 20,000 tensors); pass --variants to include it"
            )
        cases.append(Case("many_small", [MANY_SMALL[1]] * MANY_SMALL[0], ms_variants, ms_notes))
    record = {
        "command": ["python", _script_name(), *(sys.argv[1:] if argv is None else argv)],
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "environment": env,
        "hyperparameters": dict(HYPER, betas=list(BETAS), start_step=START_STEP),
        "traffic_model": {
            "fused_fp32": 28,
            "amsgrad": "+8",
            "grad_16bit": "-2",
            "statistics_pass": "+4 read (FP32 gradients; +2 for 16-bit)",
            "clip_grad_norm": "+12 (norm read, scale read+write)",
            "grad_scaler_unscale": "+8 (read+write)",
            "staged_seed": 48,
            "stream_add": 12,
            "d2d_copy": 8,
        },
        "cases": [],
    }

    def write_json(final: bool) -> None:
        # Rewritten after every case, so that a run stopped part-way (a timeout) keeps
        # the cases it finished.
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")
            if final:
                print(f"json: {args.json}")

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)  # `timeout` sends SIGTERM: still write JSON
    status = 0
    record["exit_status"] = None
    busy = _busy(env.get("loadavg"))
    if busy:
        print(f"WARNING: {busy} before the run: timings will be noisy")
    try:
        for case in cases:
            out = run_case(case, args, device, grad_dtype)
            # Note [Noise flags]: a variant whose slowest batch took more than max_spread
            # times its fastest was disturbed; its ratios are flagged, not silently shown.
            out["max_spread"] = args.max_spread
            out["noisy_variants"] = [
                name for name, r in out["results"].items()
                if r.get("min_ms") and r["max_ms"] / r["min_ms"] > args.max_spread
            ]  # fmt: skip
            if out["noisy_variants"]:
                print(
                    f"   WARNING: the batches of {', '.join(out['noisy_variants'])} spread by "
                    f"more than {args.max_spread}x (max / min): the machine was busy during "
                    "this case, so its ratios are not trustworthy; rerun it on a quiet machine "
                    "(the 'fastest' column compares the best batches)"
                )
            record["cases"].append(out)
            write_json(final=False)
            if out["divergence"]:
                status = 1
                break
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
        print(f"bench_adamw: stopped (exit {status}) after {len(record['cases'])} case(s)")
        raise
    finally:
        record["summary"] = print_summary(record["cases"], device) if record["cases"] else {}
        record["environment"]["loadavg_after"] = _loadavg()
        record["exit_status"] = status
        print(
            f"load average before {env.get('loadavg')}, after "
            f"{record['environment']['loadavg_after']} ({os.cpu_count()} CPUs)"
        )
        noisy = {c["case"]: c["noisy_variants"] for c in record["cases"] if c.get("noisy_variants")}
        record["noisy_cases"] = noisy
        if noisy or _busy(record["environment"]["loadavg_after"]):
            print("WARNING: noisy run (see the warnings above): rerun before quoting ratios")
        write_json(final=True)
        if args.plot and record["cases"]:
            make_plot(args.plot, record["cases"])
    if status:
        print("bench_adamw: FAILED: variants diverged (see above)", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
