"""Benchmark: the fused step on 16-bit (or FP64) parameters against torch's fused AdamW on
the same parameters, side by side in one process.

Variants (each steps its own copy of the same parameters and gradients):
    torch_fused    torch.optim.AdamW(fused=True) on the parameters (moments in their dtype)
    ours           ruda_torch.AdamW(fused_step=True): FP32 math, FP32 moments
    ours_master    ... with master_weights=True (FP16/BF16)
    ours_remainder ... with master_weights="remainder" (BF16): the same master in 2 bytes
    ours_sr        ... with stochastic_rounding=True (BF16)
    torch_fp32     torch's fused step on FP32 copies (what a model kept in FP32 costs)
    copy           b.copy_(a) on FP32 buffers of the same element count: the machine's
                   streaming rate, measured in the same run

Samples of all variants are interleaved (round r runs every variant once), so that a
slow period of a noisy machine hits all of them; the summary gives medians, the spread
(max / min of the samples) and ratios "torch / ours" (> 1: ours faster), and flags a
comparison whose samples spread by more than --max-spread. Bytes per element follow
docs/performance.md's traffic model.

    .venv/bin/python benchmarks/bench_param_dtypes.py --elements 20M --tensors 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adamw import environment, parse_elements  # noqa: E402

import ruda_torch  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def traffic(variant: str, dtype: torch.dtype) -> int:
    """Bytes per element one step moves (Note [Traffic model] in benchmarks/bench_adamw.py)."""
    b = torch.empty((), dtype=dtype).element_size()
    if variant == "copy":
        return 8
    if variant == "torch_fp32":
        return 28  # read p, g, m, v; write p, m, v (FP32)
    if variant == "torch_fused":
        return 7 * b  # everything in the parameters' dtype
    state = 8 if dtype == torch.float64 else 4
    base = 2 * b + b + 4 * state  # read p, g; write p; read+write m, v
    if variant == "ours_master":
        base += 2 * 4  # read + write the FP32 master
    if variant == "ours_remainder":
        base += 2 * 2  # read + write the int16 remainder
    return base


def make_variant(name: str, dtype, sizes, grads32, lr_kwargs):
    device = grads32[0].device
    pdtype = torch.float32 if name in ("torch_fp32",) else dtype
    gen = torch.Generator(device="cpu").manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(n, generator=gen).to(device=device, dtype=pdtype))
        for n in sizes
    ]
    for p, g in zip(params, grads32, strict=True):
        p.grad = g.to(pdtype)
    if name in ("torch_fused", "torch_fp32"):
        opt = torch.optim.AdamW(params, **lr_kwargs, fused=True)
    else:
        opt = ruda_torch.AdamW(
            params, **lr_kwargs, fused_step=True,
            master_weights={"ours_master": True, "ours_remainder": "remainder"}.get(name, False),
            stochastic_rounding=name == "ours_sr",
        )  # fmt: skip
    return opt.step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", default="20M", help="total elements (e.g. 20M)")
    ap.add_argument("--tensors", type=int, default=100)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--samples", type=int, default=9, help="interleaved rounds")
    ap.add_argument("--iterations", type=int, default=3, help="steps per sample")
    ap.add_argument("--max-spread", type=float, default=1.5,
                    help="flag a variant whose max/min sample ratio exceeds this")  # fmt: skip
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype]
    device = torch.device(args.device)
    (elements,) = parse_elements(args.elements)
    sizes = [elements // args.tensors + (i < elements % args.tensors) for i in range(args.tensors)]
    gen = torch.Generator(device="cpu").manual_seed(1)
    grads32 = [(torch.randn(n, generator=gen) * 1e-2).to(device) for n in sizes]
    lr_kwargs = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    names = ["torch_fused", "ours"]
    if dtype in (torch.float16, torch.bfloat16):
        names.append("ours_master")
    if dtype == torch.bfloat16:
        names += ["ours_remainder", "ours_sr"]
    names += ["torch_fp32", "copy"]
    steps = {}
    for name in names:
        if name == "copy":
            a = torch.ones(elements, device=device)
            b = torch.empty_like(a)
            steps[name] = lambda a=a, b=b: b.copy_(a)
        else:
            steps[name] = make_variant(name, dtype, sizes, grads32, lr_kwargs)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    env = environment(device)
    print(f"{args.dtype} parameters, {elements:,} elements in {args.tensors} tensors, {device}; "
          f"{env.get('cpu_model') or ''}, {torch.get_num_threads()} threads, "
          f"load average before {env.get('loadavg')}", flush=True)  # fmt: skip
    for name in names:  # warm-up: allocations, first-step state
        for _ in range(2):
            steps[name]()
    times = {n: [] for n in names}
    for r in range(args.samples):
        for name in names:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iterations):
                steps[name]()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3 / args.iterations)
        print(f"  round {r + 1}/{args.samples}: " +
              ", ".join(f"{n} {times[n][-1]:.1f} ms" for n in names), flush=True)  # fmt: skip
    load_after = environment(device).get("loadavg")
    rows = {}
    for name in names:
        med = statistics.median(times[name])
        spread = max(times[name]) / min(times[name])
        gbs = traffic(name, dtype) * elements / (med * 1e-3) / 1e9
        rows[name] = dict(median_ms=med, min_ms=min(times[name]), max_ms=max(times[name]),
                          spread=spread, bytes_per_element=traffic(name, dtype), gb_s=gbs,
                          noisy=spread > args.max_spread)  # fmt: skip
    copy_rate = rows["copy"]["gb_s"]
    print(f"\n{'variant':<12} {'median ms':>10} {'min-max ms':>16} {'B/elem':>7} {'GB/s':>7} "
          f"{'of copy':>8} {'torch_fused/this':>17}")  # fmt: skip
    for name, r in rows.items():
        ratio = rows["torch_fused"]["median_ms"] / r["median_ms"]
        r["torch_fused_over_this"] = ratio
        r["of_copy_rate"] = r["gb_s"] / copy_rate
        flag = "  NOISY" if r["noisy"] else ""
        print(f"{name:<12} {r['median_ms']:>10.2f} {r['min_ms']:>7.2f}-{r['max_ms']:<8.2f} "
              f"{r['bytes_per_element']:>7} {r['gb_s']:>7.2f} {r['of_copy_rate']:>7.0%} "
              f"{ratio:>17.2f}{flag}")  # fmt: skip
    print(f"\nratios > 1: faster than torch's fused step on {args.dtype} parameters; load "
          f"average before {env.get('loadavg')}, after {load_after}")  # fmt: skip
    if any(r["noisy"] for r in rows.values()):
        print(f"WARNING: samples of a variant spread by more than {args.max_spread}x: the "
              "machine was busy; rerun before trusting the ratios")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(environment=env, load_after=load_after,
                                             args={k: str(v) for k, v in vars(args).items()},
                                             elements=elements, rows=rows), indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
