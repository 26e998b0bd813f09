#!/usr/bin/env python3
"""Training quality with low-precision optimizer states, on real text made on this machine.

A small byte-level transformer language model is trained on the Python standard
library's own sources (every ``.py`` file under ``sysconfig``'s stdlib path, read in
sorted order; every 10th file is held out for validation), from one fixed seed, with the
same initialization, batches and learning-rate schedule for every optimizer:

  fp32               ruda_torch.AdamW(fused_step=True), FP32 moments (the reference)
  bf16               state_precision="bf16" (moments rounded stochastically: the default)
  bf16_nearest       state_precision="bf16", state_rounding="nearest"
  8bit               state_precision="8bit" (blockwise 8-bit moments for tensors of at
                     least 4,096 elements, as torchao's)
  torch              torch.optim.AdamW (FP32 moments)
  torchao_8bit       torchao.optim.AdamW8bit (where torchao is installed)
  4bit               state_precision="4bit" (blockwise 4-bit moments, same threshold)
  torchao_4bit       torchao.optim.AdamW4bit (where torchao is installed)
  emu4_nearest       the 4-bit format emulated in Python (benchmarks/emulated_4bit.py),
                     its codes rounded to nearest as the kernels do
  emu4_stochastic    the same, both moments' codes rounded stochastically
  emu4_stochastic_v  the same, only exp_avg_sq's codes rounded stochastically

and with the model's parameters in BF16 (forward, backward and gradients in BF16 too):

  bf16p_torch        torch.optim.AdamW(fused=True) on the BF16 parameters (no master)
  bf16p_rounded      ruda_torch.AdamW(fused_step=True), no master (FP32 moments)
  bf16p_master       master_weights=True (an FP32 master)
  bf16p_remainder    master_weights="remainder" (the same master in 2 bytes)
  bf16p_remainder_8bit  master_weights="remainder", state_precision="8bit" (8.03 bytes
                     per parameter with gradient)

For the BF16 runs a checksum of the parameters' bits after every step is kept, and the
report says at which step two runs' parameters first differ (bf16p_master against
bf16p_remainder: the first master that is an exact tie, Note [Remainder master] in
csrc/adamw_math.h).

With --drift, every run also keeps the exact moments of the gradients it was given (FP64
running averages, beside the optimizer, of the tensors of at least 4096 elements) and
reports, at each progress line and at the end, how far the optimizer's moments (decoded)
have drifted from them: the median ratio of its exp_avg_sq to the exact one, and the
update m / (sqrt(v) + eps) from its moments against the exact moments' (relative L2
error, ratio of norms). Rounding to nearest loses the second moment's small steps
(docs/performance.md, "The second moment's drift").

Reported: the validation loss (mean cross-entropy in nats per byte over fixed held-out
windows) after training, each run's relative difference to fp32, and the time per step.
Progress is printed as the runs go.

    .venv/bin/python benchmarks/quality_state_precision.py --steps 600
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adamw import environment  # noqa: E402
from emulated_4bit import MIN_SIZE, Emulated4bit  # noqa: E402

import ruda_torch  # noqa: E402

HYPER = dict(lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


def corpus(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(train bytes, validation bytes, train files, validation files) from the stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, val, n_train, n_val = bytearray(), bytearray(), 0, 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        if i % 10 == 9:
            if len(val) < max_bytes // 10:
                val += data
                n_val += 1
        elif len(train) < max_bytes:
            train += data
            n_train += 1
    if len(train) < 100_000 or len(val) < 10_000:
        raise SystemExit(f"too little standard-library source under {root}")
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).long()  # noqa: E731
    return as_tensor(train), as_tensor(val), n_train, n_val


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class ByteLM(nn.Module):
    def __init__(self, context: int, d: int = 128, layers: int = 4, heads: int = 4):
        super().__init__()
        self.emb = nn.Embedding(256, d)
        self.pos = nn.Parameter(torch.randn(context, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)
        mask = torch.triu(torch.full((context, context), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.emb(idx) + self.pos[:t]
        for b in self.blocks:
            x = b(x, self.mask[:t, :t])
        return self.head(self.ln(x))


RUNS = ("fp32", "bf16", "bf16_nearest", "8bit", "torch", "torchao_8bit", "4bit", "torchao_4bit",
        "emu4_nearest", "emu4_stochastic", "emu4_stochastic_v", "bf16p_torch", "bf16p_rounded",
        "bf16p_master", "bf16p_remainder", "bf16p_remainder_8bit")  # fmt: skip


def make_optimizer(name: str, params):
    if name == "torch":
        return torch.optim.AdamW(params, **HYPER)
    if name == "torchao_8bit":
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, **HYPER)
    if name == "torchao_4bit":
        from torchao.optim import AdamW4bit

        return AdamW4bit(params, **HYPER)
    if name == "bf16p_torch":
        return torch.optim.AdamW(params, **HYPER, fused=True)
    if name.startswith("emu4_"):
        m, v = dict(emu4_nearest=("nearest", "nearest"),
                    emu4_stochastic=("stochastic", "stochastic"),
                    emu4_stochastic_v=("nearest", "stochastic"))[name]  # fmt: skip
        return Emulated4bit(params, **HYPER, rounding_exp_avg=m, rounding_exp_avg_sq=v)
    kw = dict(fused_step=True, rounding_seed=1)
    if name.startswith("bf16p_master"):
        kw["master_weights"] = True
    if name.startswith("bf16p_remainder"):
        kw["master_weights"] = "remainder"
    if name.endswith("_8bit") and name.startswith("bf16p_"):
        kw["state_precision"] = "8bit"
    if name.startswith("bf16p_"):
        return ruda_torch.AdamW(params, **HYPER, **kw)
    if name.startswith("bf16"):
        kw["state_precision"] = "bf16"
    if name == "bf16_nearest":
        kw["state_rounding"] = "nearest"
    if name in ("8bit", "4bit"):
        kw["state_precision"] = name
    return ruda_torch.AdamW(params, **HYPER, **kw)


def batches(data: torch.Tensor, n: int, batch: int, context: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=gen)
        idx = starts[:, None] + torch.arange(context + 1)
        chunk = data[idx]
        yield chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model, val: torch.Tensor, context: int, windows: int) -> float:
    model.eval()
    total, count = 0.0, 0
    stride = max(1, (val.numel() - context - 1) // windows)
    starts = torch.arange(windows) * stride
    for chunk in starts.split(32):
        idx = chunk[:, None] + torch.arange(context + 1)
        x, y = val[idx][:, :-1], val[idx][:, 1:]
        loss = nn.functional.cross_entropy(
            model(x).float().reshape(-1, 256), y.reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += y.numel()
    model.train()
    return total / count


class Drift:
    """The exact moments of the gradients a run's optimizer is given, beside it, and how far
    the optimizer's own (decoded) moments are from them (--drift)."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.params = [p for p in model.parameters() if p.numel() >= MIN_SIZE]
        self.m = [torch.zeros_like(p, dtype=torch.float64) for p in self.params]
        self.v = [torch.zeros_like(p, dtype=torch.float64) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def track(self):
        """After the gradients are final (clipped), before the optimizer's step."""
        b1, b2 = HYPER["betas"]
        self.t += 1
        for p, m, v in zip(self.params, self.m, self.v, strict=True):
            g = p.grad.double()
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The optimizer's moments of self.params, flat, FP64."""
        if isinstance(self.opt, ruda_torch.AdamW):
            state = ruda_torch.dequantize_state_dict(self.opt.state_dict())["state"]
            index = {id(p): i for i, p in enumerate(self.model.parameters())}
            entries = [state[index[id(p)]] for p in self.params]
        else:
            entries = [self.opt.state[p] for p in self.params]

        def flat(key):
            out = []
            for e in entries:
                x = e[key]
                x = x.dequantize() if hasattr(x, "dequantize") else x  # torchao's subclasses
                out.append(x.detach().double().reshape(-1))
            return torch.cat(out)

        return flat("exp_avg"), flat("exp_avg_sq")

    def report(self) -> dict:
        b1, b2 = HYPER["betas"]
        eps = HYPER["eps"]
        qm, qv = self.decoded()
        m = torch.cat([x.reshape(-1) for x in self.m])
        v = torch.cat([x.reshape(-1) for x in self.v])
        bc1, bc2 = 1 - b1**self.t, 1 - b2**self.t
        u = (m / bc1) / ((v / bc2).sqrt() + eps)
        uq = (qm / bc1) / ((qv / bc2).sqrt() + eps)
        positive = v > 0
        return dict(step=self.t,
                    v_ratio_median=(qv[positive] / v[positive]).median().item(),
                    update_error=((uq - u).norm() / u.norm()).item(),
                    update_norm_ratio=(uq.norm() / u.norm()).item())  # fmt: skip


def drift_line(d: dict) -> str:
    return (f"exp_avg_sq / exact {d['v_ratio_median']:.3f} (median), update error "
            f"{d['update_error']:.3f}, |update| / exact {d['update_norm_ratio']:.3f}")  # fmt: skip


def checksum(model) -> int:
    """A position-weighted sum of the BF16 parameters' bits: equal runs, equal sums."""
    total = 0
    for p in model.parameters():
        bits = p.detach().reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF
        total += int((bits * (1 + torch.arange(bits.numel()) % 65521)).sum())
    return total


def train(name, train_data, val_data, args, seed: int) -> dict:
    torch.manual_seed(seed)
    model = ByteLM(args.context)
    if name.startswith("bf16p_"):
        model = model.to(torch.bfloat16)
    opt = make_optimizer(name, model.parameters())
    sums = []  # the parameters' bits after each step (BF16 runs)
    warmup = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            min(1.0, (s + 1) / warmup)
            * 0.5
            * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        ),
    )
    drift = Drift(model, opt) if args.drift else None
    drifts = []
    t0 = time.perf_counter()
    losses = []
    data = batches(train_data, args.steps, args.batch, args.context, seed + 7)
    for step, (x, y) in enumerate(data):
        loss = nn.functional.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if drift:
            drift.track()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if name.startswith("bf16p_"):
            sums.append(checksum(model))
        if (step + 1) % max(1, args.steps // 10) == 0:
            recent = sum(losses[-20:]) / len(losses[-20:])
            print(f"  {name} (seed {seed}): step {step + 1}/{args.steps}, train loss {recent:.4f}, "
                  f"{(time.perf_counter() - t0) / (step + 1) * 1e3:.0f} ms/step", flush=True)  # fmt: skip
            if drift:
                drifts.append(drift.report())
                print(f"    drift: {drift_line(drifts[-1])}", flush=True)
    seconds = time.perf_counter() - t0  # with --drift, its measurements included
    val = evaluate(model, val_data, args.context, args.val_windows)
    print(f"  {name} (seed {seed}): validation loss {val:.4f} nats/byte", flush=True)
    return dict(val_loss=val, train_loss_last=sum(losses[-20:]) / 20, seconds=seconds,
                ms_per_step=seconds / args.steps * 1e3, checksums=sums, drift=drifts)  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--max-bytes", type=int, default=8_000_000, help="training text (bytes)")
    ap.add_argument("--val-windows", type=int, default=512)
    ap.add_argument("--seeds", default="0", help="comma-separated: initialization and batch order")
    ap.add_argument("--runs", default="fp32,bf16,bf16_nearest,8bit,torch,torchao_8bit")
    ap.add_argument("--lr", type=float, default=HYPER["lr"], help="peak learning rate")
    ap.add_argument("--drift", action="store_true",
                    help="measure the optimizer's moments against the exact ones (slower)")  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    unknown = [n for n in args.runs.split(",") if n not in RUNS]
    if unknown:
        ap.error(f"--runs: unknown run {', '.join(map(repr, unknown))}; the runs are "
                 f"{', '.join(RUNS)}")  # fmt: skip
    HYPER["lr"] = args.lr
    train_data, val_data, n_train, n_val = corpus(args.max_bytes)
    env = environment(torch.device("cpu"))
    print(f"stdlib text: {train_data.numel():,} training bytes ({n_train} files), "
          f"{val_data.numel():,} validation bytes ({n_val} held-out files); CPU "
          f"{env.get('cpu_model')}, {torch.get_num_threads()} threads", flush=True)  # fmt: skip
    seeds = [int(x) for x in args.seeds.split(",")]
    results, skipped = {}, {}
    for name in args.runs.split(","):
        if name.startswith("torchao_"):
            try:
                import torchao.optim  # noqa: F401
            except ImportError as e:
                skipped[name] = f"torchao is not installed ({e})"
                print(f"  {name}: not run: {skipped[name]}")
                continue
        print(f"run {name}", flush=True)
        per_seed = [train(name, train_data, val_data, args, seed) for seed in seeds]
        results[name] = dict(per_seed=per_seed, seeds=seeds,
                             val_loss=sum(r["val_loss"] for r in per_seed) / len(seeds),
                             ms_per_step=sum(r["ms_per_step"] for r in per_seed) / len(seeds))  # fmt: skip
    fp32 = results.get("fp32", {}).get("per_seed", [])
    ref = {s: r["val_loss"] for s, r in zip(seeds, fp32, strict=False)}
    print("\nvalidation loss (nats/byte) per seed, and the mean; vs fp32: the mean of the "
          "per-seed relative differences")  # fmt: skip
    width = max([15] + [len(name) + 2 for name in results])
    print(f"{'run':<{width}}" + "".join(f"{'seed ' + str(s):>11}" for s in seeds)
          + f"{'mean':>10}{'vs fp32':>10}{'ms/step':>9}")  # fmt: skip
    for name, r in results.items():
        vals = [x["val_loss"] for x in r["per_seed"]]
        rel = [v / ref[s] - 1 for s, v in zip(seeds, vals, strict=True) if s in ref]
        r["vs_fp32"] = sum(rel) / len(rel) if rel else None
        print(f"{name:<{width}}" + "".join(f"{v:>11.4f}" for v in vals) + f"{r['val_loss']:>10.4f}"
              + (f"{r['vs_fp32']:>+10.2%}" if rel else f"{'-':>10}")
              + f"{r['ms_per_step']:>9.0f}")  # fmt: skip
    if args.drift:
        print("\nmoments after the last step against the exact ones of the same gradients:")
        for name, r in results.items():
            for s, x in zip(seeds, r["per_seed"], strict=True):
                if x["drift"]:
                    print(f"  {name} (seed {s}): {drift_line(x['drift'][-1])}")
    for a, b in (("bf16p_master", "bf16p_remainder"), ("bf16p_master", "bf16p_torch")):
        if a in results and b in results:
            for s, ra, rb in zip(seeds, results[a]["per_seed"], results[b]["per_seed"],
                                 strict=True):  # fmt: skip
                first = next((i + 1 for i, (x, y) in enumerate(zip(ra["checksums"],
                              rb["checksums"], strict=True)) if x != y), None)  # fmt: skip
                print(f"{a} and {b} (seed {s}): parameters "
                      + ("bit-identical after every step" if first is None
                         else f"bit-identical through step {first - 1}, first differ after "
                         f"step {first}"))  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(dict(environment=env, args=vars(args) | {"json": None},
                                             results=results, skipped=skipped), indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
