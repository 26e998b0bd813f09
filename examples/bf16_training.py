"""A BF16 model trained with FP32 master weights (whole, or as 2-byte remainders),
stochastic rounding, plain rounding and torch's fused BF16 AdamW, against the same model
trained in FP32.

A two-layer MLP learns a fixed random teacher network (regression, no noise) from the
same initialization and the same batches in every run. The BF16 runs keep the model in
bfloat16 (forward, backward and parameters); the FP32 run is the reference. Late in
training Adam's steps (about lr per element) fall below half a BF16 ulp of most weights
(2^-9 of their magnitude), so a BF16 parameter that is only rounded stops moving; the
evaluation loss of each run's weights (evaluated in FP32) shows how much of the FP32
run's progress each method keeps.

    .venv/bin/python examples/bf16_training.py --steps 400 --plot docs/images/bf16_loss_gap.png

Prints a table of evaluation losses and their gap to the FP32 run; ``--json`` writes
every number, ``--plot`` a PNG (needs matplotlib, in requirements-dev.txt).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn

import ruda_torch

DIM, HIDDEN = 64, 256
HYPER = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM))


RUNS = {
    "fp32 (torch fused)": (torch.float32, lambda p: torch.optim.AdamW(p, **HYPER, fused=True)),
    "bf16 torch fused": (torch.bfloat16, lambda p: torch.optim.AdamW(p, **HYPER, fused=True)),
    "bf16 ours, rounded": (
        torch.bfloat16,
        lambda p: ruda_torch.AdamW(p, **HYPER, fused_step=True),
    ),
    "bf16 ours, stochastic rounding": (
        torch.bfloat16,
        lambda p: ruda_torch.AdamW(p, **HYPER, fused_step=True, stochastic_rounding=True),
    ),
    "bf16 ours, master weights": (
        torch.bfloat16,
        lambda p: ruda_torch.AdamW(p, **HYPER, fused_step=True, master_weights=True),
    ),
    "bf16 ours, remainder master": (
        torch.bfloat16,
        lambda p: ruda_torch.AdamW(p, **HYPER, fused_step=True, master_weights="remainder"),
    ),
}


def train(name: str, steps: int, batch: int, eval_every: int) -> dict:
    dtype, make_opt = RUNS[name]
    teacher = make_model(1)
    model = make_model(2).to(dtype)
    opt = make_opt(model.parameters())
    gen = torch.Generator().manual_seed(3)
    x_eval = torch.randn(4096, DIM, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y_eval = teacher(x_eval)
    evals, losses = [], []

    def evaluate(step):
        with torch.no_grad():  # the weights as they are, evaluated in FP32
            fp32 = make_model(2)
            fp32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
            evals.append((step, (fp32(x_eval) - y_eval).square().mean().item()))

    evaluate(0)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(batch, DIM, generator=gen)
        with torch.no_grad():
            y = teacher(x)
        opt.zero_grad(set_to_none=True)
        loss = (model(x.to(dtype)).float() - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % eval_every == 0 or step == steps:
            evaluate(step)
    return dict(name=name, evals=evals, train_losses=losses,
                seconds=time.perf_counter() - t0)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of the curves here")
    args = ap.parse_args(argv)
    results = []
    for name in RUNS:
        print(f"training: {name} ({args.steps} steps)", flush=True)
        results.append(train(name, args.steps, args.batch, args.eval_every))
    ref = dict(results[0]["evals"])
    first = results[0]["evals"][0][1]
    print(f"\n{'run':<32} {'final eval loss':>16} {'gap to FP32':>12} {'of FP32 progress':>17}")
    for r in results:
        step, final = r["evals"][-1]
        gap = final - ref[step]
        progress = (first - final) / (first - ref[step]) if first != ref[step] else float("nan")
        r.update(final_eval=final, gap_to_fp32=gap, fraction_of_fp32_progress=progress)
        print(f"{r['name']:<32} {final:>16.6f} {gap:>+12.6f} {progress:>16.1%}")
    if args.json:
        args.json.write_text(json.dumps(dict(args=vars(args) | {"json": None, "plot": None},
                                             hyper=HYPER, results=results), indent=1))  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, gap) = plt.subplots(1, 2, figsize=(11, 4.2))
        styles = ["-", "--", ":", "-.", (0, (1, 3)), (0, (6, 2))]
        for r, style in zip(results, styles, strict=True):
            steps, vals = zip(*r["evals"], strict=True)
            ax.plot(steps, vals, linestyle=style, linewidth=2, label=r["name"])
            ratio = [v / ref[s] for s, v in r["evals"]]
            gap.plot(steps, ratio, linestyle=style, linewidth=2, label=r["name"])
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("evaluation loss (weights in FP32)")
        ax.set_title(f"BF16 MLP, AdamW lr={HYPER['lr']}")
        ax.legend()
        gap.set_xlabel("step")
        gap.set_ylabel("evaluation loss / FP32 run's")
        gap.set_title("gap to the FP32 run (1 = none)")
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
