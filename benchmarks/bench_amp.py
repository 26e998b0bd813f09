"""Benchmark: one AMP optimizer step with global-norm clipping, torch's pipeline against
ruda_torch's, under a GradScaler, side by side in one process.

    torch: scaler.unscale_(opt) + clip_grad_norm_ + scaler.step(torch fused AdamW) + update
    ours:  ruda_torch.amp.GradScaler.step(ruda_torch.AdamW(hierarchical_stats=True,
           max_grad_norm=...)) + update: one statistics pass and the step

Both start each sample from the same scaled FP32 gradients (torch's unscale_ writes them:
they are restored before each of its samples, outside the timing). Samples alternate
between the two; medians, extremes and the ratio torch / ours (> 1: ours faster) are
printed, with a WARNING when a side's samples spread by more than --max-spread.

    .venv/bin/python benchmarks/bench_amp.py --elements 50M --tensors 200
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", default="50M")
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--max-spread", type=float, default=1.5)
    args = ap.parse_args(argv)
    (n,) = parse_elements(args.elements)
    sizes = [n // args.tensors + (i < n % args.tensors) for i in range(args.tensors)]
    hyper = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)

    def params():
        gen = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(k, generator=gen)) for k in sizes]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 1024.0  # scaled by the init scale
        return ps

    def scaler(cls):
        s = cls("cpu", init_scale=1024.0, growth_interval=10**9)
        s.scale(torch.ones(()))  # creates its scale tensor, as the first scale(loss) does
        return s

    pt, po = params(), params()
    saved = [p.grad.clone() for p in pt]
    opt_t = torch.optim.AdamW(pt, **hyper, fused=True)
    opt_o = ruda_torch.AdamW(po, **hyper, fused_step=True, hierarchical_stats=True,
                             max_grad_norm=1.0)  # fmt: skip
    sc_t, sc_o = scaler(torch.amp.GradScaler), scaler(ruda_torch.amp.GradScaler)

    def run_torch():
        sc_t.unscale_(opt_t)
        torch.nn.utils.clip_grad_norm_(pt, 1.0)
        sc_t.step(opt_t)
        sc_t.update()

    def run_ours():
        sc_o.step(opt_o)
        sc_o.update()

    def restore():
        for p, g in zip(pt, saved, strict=True):
            p.grad.copy_(g)

    env = environment(torch.device("cpu"))
    print(f"{n:,} FP32 elements in {args.tensors} tensors; {env.get('cpu_model')}, "
          f"{torch.get_num_threads()} threads; load average {env.get('loadavg')}")  # fmt: skip
    for _ in range(2):
        restore()
        run_torch()
        run_ours()
    times = {"torch": [], "ours": []}
    for _ in range(args.samples):
        restore()
        t0 = time.perf_counter()
        run_torch()
        times["torch"].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        run_ours()
        times["ours"].append((time.perf_counter() - t0) * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"{k:<6} median {med[k]:.1f} ms (min {min(v):.1f}, max {max(v):.1f})")
        if max(v) / min(v) > args.max_spread:
            print(f"WARNING: {k}'s samples spread by more than {args.max_spread}x: rerun")
    print(f"torch / ours: {med['torch'] / med['ours']:.2f} (medians), "
          f"{min(times['torch']) / min(times['ours']):.2f} (fastest); load average after "
          f"{environment(torch.device('cpu')).get('loadavg')}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
