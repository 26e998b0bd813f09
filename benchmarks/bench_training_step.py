#!/usr/bin/env python3
"""Benchmark: a whole training iteration (zero_grad, forward, backward, clip, step) of an
optimizer-heavy model, with torch.optim.AdamW and with ruda_torch.AdamW, side by side in
one process (the variants alternate from one sample to the next).

Variants, each on its own copy of the same model and batch:

  torch        zero_grad(); backward; clip_grad_norm_(foreach=True); AdamW(fused=True)
  ours         ruda_torch.AdamW(fused_step=True, hierarchical_stats=True, max_grad_norm=...)
  ours_flat    the same with flat_grads=True
  ours_hooks   the evaluation of issue 11 part 3, "statistics while the gradient is in
               cache": a post-accumulate-grad hook per parameter runs the statistics of
               that gradient as soon as autograd has produced it (analyze_gradient into
               the parameter's rows), so that the step reads the gradients only once;
               emulated as the hooks, the merge of their rows, and a bare fused step (the
               kernel's cost does not depend on whether it reads a report), i.e. what the
               design would cost, without its bookkeeping.

Three models: "tiny" (2,000 linear layers of 32 x 32: 4,000 tensors, 2.1M parameters),
"many" (512 layers of 128 x 128: 1,024 tensors, 8.4M parameters) and "wide" (8 layers
of 1024 x 1024: 16 tensors, 8.4M parameters), all on a batch of 8 rows so that the optimizer's work is a large share of the iteration. Reported: median,
min and max of the iteration, and torch's median over each variant's.

    .venv/bin/python benchmarks/bench_training_step.py --samples 7
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adamw import environment  # noqa: E402

import ruda_torch  # noqa: E402
from ruda_torch import ops  # noqa: E402

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
MAX_NORM = 1.0
MODELS = {"tiny": (2000, 32), "many": (512, 128), "wide": (8, 1024)}


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class Variant:
    def __init__(self, name: str, model: nn.Module, x: torch.Tensor):
        self.name, self.model, self.x = name, model, x
        params = list(model.parameters())
        self.params = params
        if name == "torch":
            self.opt = torch.optim.AdamW(params, **HYPER, fused=True)
        elif name == "ours":
            self.opt = ruda_torch.AdamW(params, **HYPER, fused_step=True,
                                        hierarchical_stats=True, max_grad_norm=MAX_NORM)  # fmt: skip
        elif name == "ours_flat":
            self.opt = ruda_torch.AdamW(params, **HYPER, fused_step=True, flat_grads=True,
                                        hierarchical_stats=True, max_grad_norm=MAX_NORM)  # fmt: skip
        elif name == "ours_hooks":
            self.opt = ruda_torch.AdamW(params, **HYPER, fused_step=True)
            counts = [ops.stats_rows_for(p.numel()) for p in params]
            self.rows = torch.empty(sum(counts), 3)
            self.level = torch.empty(-(-sum(counts) // 1024), 3)
            self.report = torch.empty(3)
            start = 0
            for p, c in zip(params, counts, strict=True):
                rows = self.rows[start : start + c]
                start += c
                p.register_post_accumulate_grad_hook(
                    lambda q, rows=rows: ops.analyze_gradient([q.grad], rows)
                )
        else:
            raise KeyError(name)

    def iteration(self) -> None:
        self.opt.zero_grad()
        self.model(self.x).square().mean().backward()
        if self.name == "torch":
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM, foreach=True)
        elif self.name == "ours_hooks":
            ops.merge_gradient_stats(self.rows, self.level)
            ops.merge_gradient_stats_chunks(self.level, self.report)
        self.opt.step()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=7, help="alternating samples per variant")
    p.add_argument("--iterations", type=int, default=5, help="iterations per sample")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--models", default="tiny,many,wide", help="comma list of: tiny, many, wide")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(torch.device("cpu"))
    print(f"CPU: {env.get('cpu_model')} ({env['cpu_count']} logical CPUs, {env['torch_threads']} "
          f"threads, kernels {ruda_torch.cpu_capability()}); torch {torch.__version__}")  # fmt: skip
    names = ["torch", "ours", "ours_flat", "ours_hooks"]
    for model_name in args.models.split(","):
        layers, width = MODELS[model_name]
        base = make_model(layers, width)
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(1))
        variants = [Variant(n, copy.deepcopy(base), x) for n in names]
        n_params = sum(q.numel() for q in base.parameters())
        print(f"\n== {model_name}: {layers} x Linear({width}, {width}), "
              f"{2 * layers} tensors, {n_params:,} parameters, batch 8")  # fmt: skip
        times = {n: [] for n in names}
        for sample in range(args.samples + 1):  # sample 0 warms up
            for v in variants if sample % 2 else reversed(variants):
                t0 = time.perf_counter()
                for _ in range(1 if sample == 0 else args.iterations):
                    v.iteration()
                if sample:
                    times[v.name].append((time.perf_counter() - t0) / args.iterations)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        print(f"   {'variant':<11} {'median ms':>10} {'min':>8} {'max':>8} {'torch / this':>13}")
        for n in names:
            ms = [t * 1e3 for t in times[n]]
            print(f"   {n:<11} {med[n]:>10.2f} {min(ms):>8.2f} {max(ms):>8.2f} "
                  f"{med['torch'] / med[n]:>13.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
