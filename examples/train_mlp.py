"""Train one small MLP twice: with ``torch.optim.AdamW`` and with ``ruda_torch.AdamW``.

The task needs no downloads: a fixed, randomly initialised "teacher" network labels
Gaussian inputs and a wider student MLP learns to imitate it (regression, MSE loss). Both
runs start from identical weights, see the same batches in the same order and use the same
explicit hyperparameters. They are stepped alternately, one step each in turn, so that the
machine's noise hits both timings alike.

ruda_torch's defaults differ from torch's (eps=1e-5 vs 1e-8, weight_decay=1e-4 vs 1e-2), so
every hyperparameter is passed explicitly to both optimizers.

    python examples/train_mlp.py                    # CPU, about 300 steps
    python examples/train_mlp.py --device cuda      # on a GPU
    python examples/train_mlp.py --clip 1.0         # global-norm clipping on both sides
    python examples/train_mlp.py --plot out/demo.png  # also draw the curves (matplotlib)

The timing columns are the optimizer step alone (with --clip, torch's clip_grad_norm_ plus
its step, against our step that clips inside), median over each reporting interval. The run
exits with status 1 if a loss is not finite or the two final losses differ by more than
--max-loss-rel-diff.
"""

import argparse
import copy
import math
import statistics
import sys
import time

import torch
from torch import nn

try:
    import ruda_torch
except ImportError:
    print(
        "error: cannot import ruda_torch; build it first (`make build`, or "
        "`pip install --no-build-isolation -e .` in the repository root)",
        file=sys.stderr,
    )
    raise

IN_FEATURES = 64
OUT_FEATURES = 8
TEACHER_HIDDEN = 128
TRAIN_SAMPLES = 16384
EVAL_SAMPLES = 2048


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--hidden", type=int, default=512, help="student hidden width (default 512)")
    p.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    p.add_argument("--seed", type=int, default=0, help="seed for data and weights (default 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--amsgrad", action="store_true", help="use AMSGrad on both sides")
    p.add_argument(
        "--clip",
        type=float,
        default=None,
        metavar="MAX_NORM",
        help="clip the global gradient norm: torch's clip_grad_norm_ on the torch side, "
        "AdamW(hierarchical_stats=True, max_grad_norm=MAX_NORM) on ours",
    )
    p.add_argument(
        "--torch-impl",
        choices=("default", "foreach", "fused"),
        default="default",
        help="implementation of torch.optim.AdamW to compare against (default: torch's choice)",
    )
    p.add_argument("--report-every", type=int, default=25, help="table row interval (default 25)")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PNG",
        help="write training and eval loss of both optimizers and their step times to this "
        "PNG (needs matplotlib, in requirements-dev.txt)",
    )
    p.add_argument(
        "--max-loss-rel-diff",
        type=float,
        default=0.05,
        help="fail if the final eval losses differ by more than this fraction (default 0.05)",
    )
    args = p.parse_args()
    if args.steps < 1 or args.hidden < 1 or args.batch < 1 or args.report_every < 1:
        p.error("--steps, --hidden, --batch and --report-every must be positive")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device} requested but torch.cuda.is_available() is False")
    return args


def make_data(seed, device):
    """Gaussian inputs labelled by a fixed random teacher; targets scaled to unit variance."""
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(IN_FEATURES, TEACHER_HIDDEN, generator=gen) / math.sqrt(IN_FEATURES)
    b1 = 0.1 * torch.randn(TEACHER_HIDDEN, generator=gen)
    w2 = torch.randn(TEACHER_HIDDEN, OUT_FEATURES, generator=gen) / math.sqrt(TEACHER_HIDDEN)
    x = torch.randn(TRAIN_SAMPLES + EVAL_SAMPLES, IN_FEATURES, generator=gen)
    y = torch.tanh(x @ w1 + b1) @ w2
    y = (y - y.mean(0)) / y.std(0)
    x, y = x.to(device), y.to(device)
    return (x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES]), (x[TRAIN_SAMPLES:], y[TRAIN_SAMPLES:])


def make_model(hidden, seed, device):
    torch.manual_seed(seed + 1)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, hidden),
        nn.GELU(),
        nn.Linear(hidden, hidden),
        nn.GELU(),
        nn.Linear(hidden, OUT_FEATURES),
    ).to(device)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Run:
    """One model with its optimizer; ``train_step`` returns (batch loss, optimizer ms)."""

    def __init__(self, name, model, optimizer, clip_outside, device):
        self.name = name
        self.model = model
        self.optimizer = optimizer
        self.clip_outside = clip_outside  # torch side: clip_grad_norm_ before step()
        self.device = device
        self.step_ms = []
        self.train_losses = []
        self.eval_losses = []  # (step, loss)

    def train_step(self, x, y):
        self.optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        sync(self.device)
        start = time.perf_counter()
        if self.clip_outside is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_outside)
        self.optimizer.step()
        sync(self.device)
        self.step_ms.append(1e3 * (time.perf_counter() - start))
        self.train_losses.append(loss.detach())
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, x, y):
        return nn.functional.mse_loss(self.model(x), y).item()


def write_plot(path, runs, args):
    """Training loss, eval loss and optimizer step time of both runs, as a PNG."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for run, style in zip(runs, ("-", "--"), strict=True):
        label = "torch.optim.AdamW" if run.name == "torch" else "ruda_torch.AdamW(fused_step=True)"
        losses = [loss.item() for loss in run.train_losses]
        axes[0].plot(range(1, len(losses) + 1), losses, style, label=label, linewidth=1)
        steps, evals = zip(*run.eval_losses, strict=True)
        axes[1].plot(steps, evals, style, marker="o", markersize=3, label=label)
        axes[2].plot(range(1, len(run.step_ms) + 1), run.step_ms, style, label=label, linewidth=1)
    axes[0].set(title="training loss (batch)", xlabel="step", yscale="log")
    axes[1].set(title="eval loss", xlabel="step", yscale="log")
    axes[2].set(title="optimizer step time", xlabel="step", ylabel="ms", yscale="log")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(f"MLP {args.hidden} hidden, {args.steps} steps, lr={args.lr:g}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {os.path.abspath(path)}")


def main():
    args = parse_args()
    device = torch.device(args.device)
    (x_train, y_train), (x_eval, y_eval) = make_data(args.seed, device)

    base = make_model(args.hidden, args.seed, device)
    n_params = sum(p.numel() for p in base.parameters())
    hyper = dict(lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=args.amsgrad)

    torch_model = copy.deepcopy(base)
    torch_impl = {} if args.torch_impl == "default" else {args.torch_impl: True}
    torch_opt = torch.optim.AdamW(torch_model.parameters(), **hyper, **torch_impl)

    ruda_model = copy.deepcopy(base)
    ruda_extra = {}
    if args.clip is not None:
        ruda_extra = dict(hierarchical_stats=True, max_grad_norm=args.clip)
    ruda_opt = ruda_torch.AdamW(ruda_model.parameters(), **hyper, fused_step=True, **ruda_extra)

    runs = [
        Run("torch", torch_model, torch_opt, args.clip, device),
        Run("ruda", ruda_model, ruda_opt, None, device),
    ]

    layers = f"{IN_FEATURES}-{args.hidden}-{args.hidden}-{OUT_FEATURES}"
    print(
        f"MLP {layers} ({n_params:,} parameters) learning a fixed random teacher; "
        f"{args.steps} steps, batch {args.batch}, device {device}, seed {args.seed}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads"
    )
    print(
        f"both optimizers: lr={args.lr:g} betas=(0.9, 0.999) eps=1e-8 weight_decay=1e-2 "
        f"amsgrad={args.amsgrad} clip={args.clip}"
    )
    print(
        f"torch: torch.optim.AdamW({args.torch_impl} implementation)"
        + (" + clip_grad_norm_" if args.clip is not None else "")
    )
    print(
        f"ruda:  ruda_torch.AdamW(fused_step=True{''.join(f', {k}={v}' for k, v in ruda_extra.items())})"
    )
    print()
    header = (
        f"{'step':>6} | {'eval loss torch':>15} | {'eval loss ruda':>14} | "
        f"{'opt ms/step torch':>17} | {'opt ms/step ruda':>16}"
    )
    print(header)
    print("-" * len(header))
    init = [run.eval_loss(x_eval, y_eval) for run in runs]
    for run, loss in zip(runs, init, strict=True):
        run.eval_losses.append((0, loss))
    print(f"{0:>6} | {init[0]:>15.6f} | {init[1]:>14.6f} | {'-':>17} | {'-':>16}")

    gen = torch.Generator().manual_seed(args.seed + 2)
    last_report = 0
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, TRAIN_SAMPLES, (args.batch,), generator=gen).to(device)
        x, y = x_train[idx], y_train[idx]
        # Alternate which optimizer goes first so neither always runs on a warm cache.
        for run in runs if step % 2 else runs[::-1]:
            run.train_step(x, y)
        if step % args.report_every == 0 or step == args.steps:
            losses = [run.eval_loss(x_eval, y_eval) for run in runs]
            for run, loss in zip(runs, losses, strict=True):
                run.eval_losses.append((step, loss))
            times = [statistics.median(run.step_ms[last_report:step]) for run in runs]
            print(
                f"{step:>6} | {losses[0]:>15.6f} | {losses[1]:>14.6f} | "
                f"{times[0]:>17.3f} | {times[1]:>16.3f}"
            )
            last_report = step

    final = [run.eval_loss(x_eval, y_eval) for run in runs]
    max_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(torch_model.parameters(), ruda_model.parameters(), strict=True)
    )
    max_abs = max(p.abs().max().item() for p in torch_model.parameters())
    # The first steps include one-time setup (state allocation, bucket building).
    skip = min(5, args.steps - 1)
    med = [statistics.median(run.step_ms[skip:]) for run in runs]
    rel = abs(final[1] - final[0]) / max(abs(final[0]), 1e-12)

    print()
    print(
        f"final eval loss: torch {final[0]:.6f}, ruda {final[1]:.6f} (relative difference {rel:.2e})"
    )
    print(f"max |parameter difference|: {max_diff:.3e} (largest |parameter| {max_abs:.3e})")
    print(
        f"median optimizer step (after {skip} warm-up steps): torch {med[0]:.3f} ms, "
        f"ruda {med[1]:.3f} ms, speed-up torch/ruda {med[0] / med[1]:.2f} (> 1: ruda faster, "
        "the benchmarks' convention)"
    )

    if args.plot:
        write_plot(args.plot, runs, args)

    if not all(math.isfinite(v) for v in final + [max_diff]):
        print("FAILED: a loss or parameter is not finite", file=sys.stderr)
        return 1
    if rel > args.max_loss_rel_diff:
        print(
            f"FAILED: final losses differ by {rel:.2%} (more than {args.max_loss_rel_diff:.0%})",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
