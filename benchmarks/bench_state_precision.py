#!/usr/bin/env python3
"""Benchmark: the bare AdamW step with low-precision optimizer states (Note [Low-precision
states] in csrc/adamw_math.h) against torch's fused FP32 step, in one run.

Variants, the same FP32 parameters and gradients for each (its own copy):
  torch_fused      torch.optim.AdamW(fused=True), FP32 moments (the anchor)
  ours_fp32        ruda_torch.AdamW(fused_step=True), FP32 moments
  ours_bf16        ruda_torch.AdamW(fused_step=True, state_precision="bf16")
  ours_8bit        ruda_torch.AdamW(fused_step=True, state_precision="8bit"): blockwise
                   8-bit moments (Note [8-bit moments] in csrc/quant8.h)
  torchao_8bit     torchao.optim.AdamW8bit (where torchao is installed; skipped otherwise)
  ours_4bit        ruda_torch.AdamW(fused_step=True, state_precision="4bit"): blockwise
                   4-bit moments, two codes a byte (Note [4-bit moments] in csrc/quant4.h)
  torchao_4bit     torchao.optim.AdamW4bit (where torchao is installed; skipped otherwise)
  torch_fused_bf16 torch's fused step with BF16 moment tensors (torch 2.13/2.14 refuse it on
                   the CPU; the refusal is reported, and on a GPU it runs)
  stream_add       a.add_(b) over the same number of FP32 elements: the machine's own
                   streaming rate (12 bytes per element), as in bench_adamw.py
The variants alternate (forward, then reversed) from one sample to the next; reported
are the median, min and max per step, each variant's median ratio to torch_fused, and
its bandwidth by the traffic model (bytes per element of one step: FP32 moments 28
(parameter read and written, gradient read, two moments read and written), BF16 moments
20, 8-bit moments 16 plus a scale per block, 4-bit moments 14 plus a scale per block)
against stream_add's. --variants runs a subset (torch_fused, the anchor, always runs).
Also the optimizer state's bytes per parameter element, counted from the state itself.
Tensor sizes are rounded to multiples of 256 (50M in 200 tensors: 200 x 250,112), so
that torchao quantizes every tensor.

    .venv/bin/python benchmarks/bench_state_precision.py --elements 50M --tensors 200
    .venv/bin/python benchmarks/bench_state_precision.py --elements 20M --tensors 100 --row 1000
    .venv/bin/python benchmarks/bench_state_precision.py --elements 20M --tensors 100 \
        --variants ours_fp32,ours_8bit,ours_4bit,stream_add
    .venv/bin/python benchmarks/bench_state_precision.py --device cuda --elements 256M \
        --iterations 10 --json states.json   # on a GPU (tools/gpu_check.sh runs it)

On a GPU (--device cuda) every sample is timed between two synchronizations of the
device.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adamw import environment, parse_elements  # noqa: E402

import ruda_torch  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
TRAFFIC = {"torch_fused": 28, "ours_fp32": 28, "ours_bf16": 20, "ours_8bit": 16,
           "torchao_8bit": 16, "ours_4bit": 14, "torchao_4bit": 14, "torch_fused_bf16": 20,
           "stream_add": 12}  # fmt: skip
NAMES = ("torch_fused", "ours_fp32", "ours_bf16", "ours_8bit", "torchao_8bit", "ours_4bit",
         "torchao_4bit", "torch_fused_bf16", "stream_add")  # fmt: skip


def make_params(sizes: list, seed: int, device: torch.device) -> list[torch.nn.Parameter]:
    """A parameter of each size (an element count, or a shape), with a gradient, on
    `device`."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in sizes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(device)
    return params


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state but the step counters."""
    total = 0
    for entry in opt.state.values():
        for key, v in entry.items():
            if key == "step" or not isinstance(v, torch.Tensor):
                continue
            inner = [getattr(v, a) for a in getattr(v, "__tensor_flatten__", lambda: ([], 0))()[0]]
            for t in inner or [v]:
                total += t.numel() * t.element_size()
    return total


def build(name: str, sizes: list, device: torch.device):
    """(step function, optimizer) of a variant, or (None, reason) where it cannot run."""
    params = make_params(sizes, seed=0, device=device)
    if name == "torch_fused":
        opt = torch.optim.AdamW(params, fused=True, **HYPER)
    elif name == "ours_fp32":
        opt = ruda_torch.AdamW(params, fused_step=True, **HYPER)
    elif name == "ours_bf16":
        opt = ruda_torch.AdamW(params, fused_step=True, state_precision="bf16", **HYPER)
    elif name == "ours_8bit":
        opt = ruda_torch.AdamW(params, fused_step=True, state_precision="8bit", **HYPER)
    elif name == "ours_4bit":
        opt = ruda_torch.AdamW(params, fused_step=True, state_precision="4bit", **HYPER)
    elif name in ("torchao_8bit", "torchao_4bit"):
        try:
            from torchao import optim as ao
        except ImportError as e:
            return None, f"torchao is not installed ({e})"
        opt = (ao.AdamW8bit if name == "torchao_8bit" else ao.AdamW4bit)(params, **HYPER)
    elif name == "torch_fused_bf16":
        opt = torch.optim.AdamW(params, fused=True, **HYPER)
        for p in params:
            opt.state[p] = {
                "step": torch.tensor(0.0, device=device),
                "exp_avg": torch.zeros_like(p, dtype=torch.bfloat16),
                "exp_avg_sq": torch.zeros_like(p, dtype=torch.bfloat16),
            }
    elif name == "stream_add":
        n = sum(math.prod(s) if isinstance(s, tuple) else s for s in sizes)
        a, b = torch.randn(n, device=device), torch.randn(n, device=device) * 1e-9
        return (lambda: a.add_(b)), None
    else:
        raise KeyError(name)
    try:
        opt.step()  # first step: state, compilation
    except RuntimeError as e:
        return None, f"refused: {str(e).splitlines()[0]}"
    return opt.step, opt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", default="50M", help="parameter elements (default: 50M)")
    ap.add_argument("--tensors", type=int, default=200, help="tensors they are split into")
    ap.add_argument("--samples", type=int, default=7, help="alternating samples per variant")
    ap.add_argument("--iterations", type=int, default=3, help="steps per sample")
    ap.add_argument("--warmup", type=int, default=2, help="steps per variant before measuring")
    ap.add_argument("--row", type=int, default=0,
                    help="2-D tensors of rows of this many elements (default 0: 1-D tensors); "
                         "rows that are not whole blocks of 256 make the 8-bit blocks each "
                         "row's (Note [8-bit row blocks] in csrc/quant8.h)")  # fmt: skip
    ap.add_argument("--variants", default=",".join(NAMES),
                    help="comma-separated variants to run (default: all): "
                         + ", ".join(NAMES))  # fmt: skip
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where the parameters and the state live (default: cpu)",
    )
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    wanted = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(wanted) - set(NAMES))
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(NAMES)}")
    if args.row < 0:
        ap.error(f"--row must be 0 (1-D tensors) or a row length, got {args.row}")
    n = parse_elements(args.elements)[0]
    # Multiples of 256: torchao quantizes only tensors whose size its block (256) divides,
    # and keeps the others FP32 (50M / 200 = 250,000 is not one); and of the row length.
    unit = math.lcm(256, args.row) if args.row else 256
    each = max(unit, round(n / args.tensors / unit) * unit)
    sizes = [(each // args.row, args.row) if args.row else each] * args.tensors
    n = each * args.tensors
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here")
    env = environment(device)
    shape = f"{each // args.row} x {args.row}" if args.row else f"{each:,}"
    where = (f"GPU {env.get('gpu_name')}" if device.type == "cuda" else
             f"CPU {env.get('cpu_model')}, {torch.get_num_threads()} threads, ruda_torch's "
             f"{env['ruda_torch_cpu_isa']} build, torch's {env['torch_cpu_capability']} kernels")  # fmt: skip
    print(f"{n:,} FP32 elements in {args.tensors} tensors of {shape}; {where}, "
          f"torch {torch.__version__}", flush=True)  # fmt: skip
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = [v for v in NAMES if v == "torch_fused" or v in wanted]
    steps, skipped, bytes_per = {}, {}, {}
    for name in names:
        print(f"  setting up {name} ...", flush=True)
        fn, opt = build(name, sizes, device)
        if fn is None:
            skipped[name] = opt
            print(f"  {name}: {opt}", flush=True)
            continue
        for _ in range(args.warmup):
            fn()
        steps[name] = fn
        if isinstance(opt, torch.optim.Optimizer):
            bytes_per[name] = state_bytes(opt) / n
    times = {name: [] for name in steps}
    order = list(steps)
    for s in range(args.samples):
        for name in order if s % 2 == 0 else order[::-1]:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.iterations):
                steps[name]()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3 / args.iterations)
        print(f"  sample {s + 1}/{args.samples}: "
              + ", ".join(f"{k} {v[-1]:.1f} ms" for k, v in times.items()), flush=True)  # fmt: skip
    stream = times.get("stream_add")
    stream_gbs = 12 * n / statistics.median(stream) / 1e6 if stream else None
    anchor = statistics.median(times["torch_fused"])
    rows = {}
    print(f"\n{'variant':<18}{'median ms':>10}{'min':>8}{'max':>8}{'vs torch':>10}"
          f"{'GB/s':>8}{'of add_':>9}{'state B/elem':>14}")  # fmt: skip
    for name, ts in times.items():
        med = statistics.median(ts)
        gbs = TRAFFIC[name] * n / med / 1e6
        row = dict(median_ms=med, min_ms=min(ts), max_ms=max(ts), samples=ts,
                   speedup_vs_torch_fused=anchor / med, model_gbs=gbs,
                   of_stream_add=gbs / stream_gbs if stream_gbs else None,
                   state_bytes_per_element=bytes_per.get(name))  # fmt: skip
        rows[name] = row
        sb = f"{bytes_per[name]:.3f}" if name in bytes_per else "-"
        print(f"{name:<18}{med:>10.1f}{min(ts):>8.1f}{max(ts):>8.1f}{anchor / med:>9.2f}x"
              f"{gbs:>8.1f}{row['of_stream_add'] or 0:>8.0%}{sb:>14}")  # fmt: skip
    for name, why in skipped.items():
        print(f"{name:<18}not run: {why}")
    if args.json:
        args.json.write_text(json.dumps(dict(environment=env, device=args.device, elements=n,
                                             tensors=args.tensors, row=args.row, results=rows,
                                             skipped=skipped),
                                        indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
