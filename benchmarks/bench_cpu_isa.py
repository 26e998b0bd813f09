#!/usr/bin/env python3
"""Benchmark: the ISA builds of the CPU kernels side by side in one process (Note [CPU ISA
at run time] in csrc/cpu/dispatch.cpp).

For every build this CPU runs, the same fused AdamW step (FP32 parameters and gradients;
then BF16 parameters) and the same statistics pass (analyze_gradient over FP32
gradients) are timed, the builds alternating from one sample to the next
(``ruda_torch._build.use_cpu_isa``), with torch.optim.AdamW(fused=True) and ``a.add_(b)``
measured in the same run as references. Each build starts from the same state, and
after the run the builds' parameters are compared bit for bit (they must be equal).
Reported: median, min and max per step, and each build's median against the default
build's and torch's.

    .venv/bin/python benchmarks/bench_cpu_isa.py --elements 20M --tensors 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adamw import environment, parse_elements  # noqa: E402

import ruda_torch  # noqa: E402
from ruda_torch import _build, ops  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def make_params(n: int, tensors: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = [n // tensors + (1 if i < n % tensors else 0) for i in range(tensors)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)
    return params


def timed(fn, iterations: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - t0) / iterations


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--elements", default="20M", help="parameter elements (default: 20M)")
    p.add_argument("--tensors", type=int, default=100, help="tensors they are split into")
    p.add_argument("--samples", type=int, default=7, help="alternating samples per variant")
    p.add_argument("--iterations", type=int, default=5, help="steps per sample")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = parse_elements(args.elements)
    if len(sizes) != 1:
        p.error("--elements takes one count here (e.g. 20M)")
    n = sizes[0]
    isas = [i for i in _build.CPU_ISAS_BUILT if i in _build.CPU_ISAS_SUPPORTED]
    env = environment(torch.device("cpu"))
    print(f"CPU: {env.get('cpu_model')} ({env['cpu_count']} logical CPUs, {env['torch_threads']} "
          f"threads); torch {torch.__version__}; builds run here: {', '.join(isas)}; "
          f"built: {', '.join(_build.CPU_ISAS_BUILT)}")  # fmt: skip
    print(f"{n:,} elements in {args.tensors} tensors, {args.samples} samples x "
          f"{args.iterations} steps")  # fmt: skip
    variants = {}
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for isa in isas:
            params = make_params(n, args.tensors, dtype, seed=1)
            opt = ruda_torch.AdamW(params, **HYPER, fused_step=True)
            variants[f"{tag} step, {isa}"] = (isa, opt.step, params)
        params = make_params(n, args.tensors, dtype, seed=1)
        opt = torch.optim.AdamW(params, **HYPER, fused=True)
        variants[f"{tag} step, torch fused"] = (None, opt.step, params)
    grads = [g.grad for g in make_params(n, args.tensors, torch.float32, seed=2)]
    rows = torch.empty(sum(ops.stats_rows_for(g.numel()) for g in grads), 3)
    for isa in isas:
        variants[f"statistics, {isa}"] = (isa, lambda: ops.analyze_gradient(grads, rows), None)
    a, b = torch.randn(n), torch.randn(n)
    variants["a.add_(b)"] = (None, lambda: a.add_(b), None)
    times = {k: [] for k in variants}
    names = list(variants)
    for sample in range(args.samples + 1):  # sample 0 warms up
        for name in names if sample % 2 else reversed(names):
            isa, fn, _ = variants[name]
            if isa is not None:
                _build.use_cpu_isa(isa)
            t = timed(fn, 1 if sample == 0 else args.iterations)
            if sample:
                times[name].append(t)
    _build.use_cpu_isa(_build.CPU_ISA)
    for tag in ("fp32", "bf16"):
        ref = variants[f"{tag} step, {isas[0]}"][2]
        for isa in isas[1:]:
            got = variants[f"{tag} step, {isa}"][2]
            if not all(torch.equal(x, y) for x, y in zip(ref, got, strict=True)):
                print(f"ERROR: the {isa} build's {tag} parameters differ from {isas[0]}'s")
                return 1
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"\n{'variant':<26} {'median ms':>10} {'min':>8} {'max':>8} {'vs default':>11} "
          f"{'vs torch':>9}")  # fmt: skip
    for name in names:
        v = [t * 1e3 for t in times[name]]
        kind = name.split(",")[0]
        base = med.get(f"{kind}, default")
        torch_ref = med.get(f"{kind}, torch fused")
        vs_def = f"{base / med[name]:.2f}x" if base and "torch" not in name else ""
        vs_torch = f"{torch_ref / med[name]:.2f}x" if torch_ref else ""
        print(f"{name:<26} {med[name]:>10.2f} {min(v):>8.2f} {max(v):>8.2f} {vs_def:>11} "
              f"{vs_torch:>9}")  # fmt: skip
    print("\n(vs default / vs torch > 1: faster than the default build / torch's fused step; "
          "the builds' parameters were equal bit for bit)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
