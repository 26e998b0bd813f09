#!/usr/bin/env python3
"""torchtitan's debug Llama trained on the CPU with and without the flag
``--override.imports ruda_torch.integrations.torchtitan.adamw`` (docs/integrations.md).

torchtitan's trainer expects a GPU and its attention has no backward on a CPU, so the run
drives torchtitan's own parts as its trainer does: the config from the command line
(``ConfigManager.parse_args`` of ``--module llama3 --config llama3_debugmodel``, with or
without the flag, and ``apply_overrides``), the model it builds (6.1M parameters) with its
inner attention replaced by ``ScaledDotProductAttention`` (the math backend: a CPU
attention with a backward, causal), ``optimizer.build``, ``lr_scheduler.build``, and per
step the trainer's sequence: forward and backward, ``dist_utils.clip_grad_norm_`` with
``training.max_norm``, ``optimizers.step()``, ``lr_schedulers.step()``, the loss and
``grad_norm.item()`` logged. The text is real: the Python standard library's sources,
as bytes (token ids 0-255 of the model's 2048).

Runs, from the same initial weights and batches, stepped in turn (so that their times are
measured side by side):
  stock        torchtitan's AdamW (torch.optim.AdamW, fused) and its clip
  ruda-fp32    the flag
  ruda-8bit    the flag with {"state_precision": "8bit"}

Reported per step: loss and grad_norm of each run; per run: the optimizer's time per step
(the clip call and optimizers.step(), median and spread over the steps after the first),
the optimizer state's bytes per parameter, and the largest relative error of the logged
grad_norm against the FP64 norm of the same gradients (computed outside the timing).

    .venv/bin/python benchmarks/torchtitan_cpu_run.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_adamw import environment  # noqa: E402

FLAG = "ruda_torch.integrations.torchtitan.adamw"
RUNS = {"stock": None, "ruda-fp32": {}, "ruda-8bit": {"state_precision": "8bit"}}


def text(max_bytes: int) -> torch.Tensor:
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts):
        data += path.read_bytes()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data, dtype=torch.uint8).long()


def build(flag_kwargs, steps: int, seed: int):
    from torchtitan.config import ConfigManager
    from torchtitan.config.override import apply_overrides
    from torchtitan.models.common.attention import ScaledDotProductAttention

    args = ["--module", "llama3", "--config", "llama3_debugmodel", "--training.steps", str(steps)]
    if flag_kwargs is not None:
        args += ["--override.imports", f"{FLAG}={json.dumps(flag_kwargs)}"]
    cfg = ConfigManager().parse_args(args)
    apply_overrides(cfg.override, cfg)
    torch.manual_seed(seed)
    model = cfg.model_spec.model.build()
    for layer in model.layers.values():  # a CPU attention with a backward
        attention = ScaledDotProductAttention(ScaledDotProductAttention.Config())
        attention.sdpa_backends = [torch.nn.attention.SDPBackend.MATH]
        layer.attention.inner_attention = attention
    opts = cfg.optimizer.build(model_parts=[model])
    schedulers = cfg.lr_scheduler.build(optimizers=opts, training_steps=steps)
    return cfg, model, opts, schedulers


def state_bytes_per_param(model, opts) -> float:
    seen, total = set(), 0
    for optim in opts.optimizers:
        for entry in optim.state.values():
            for key, t in entry.items():
                local = t.to_local() if hasattr(t, "to_local") else t
                if key == "step" or not isinstance(local, torch.Tensor):
                    continue
                if id(local) not in seen:
                    seen.add(id(local))
                    total += local.numel() * local.element_size()
    return total / sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    from torchtitan.distributed import utils as dist_utils

    tokens = text(4_000_000)
    gen = torch.Generator().manual_seed(args.seed)
    starts = torch.randint(0, tokens.numel() - args.seq_len - 1,
                           (args.steps, args.batch), generator=gen)  # fmt: skip
    runs = {name: build(kw, args.steps, args.seed) for name, kw in RUNS.items()}
    first = next(iter(runs.values()))[1]
    for _, model, _, _ in runs.values():  # the same initial weights
        model.load_state_dict(first.state_dict())
    log = {name: {"loss": [], "grad_norm": [], "norm_rel_error": [], "opt_s": []} for name in runs}
    print(f"{'step':>4} " + " ".join(f"{n + ' loss':>16} {n + ' norm':>16}" for n in runs))
    for step in range(args.steps):
        window = torch.stack([tokens[s : s + args.seq_len + 1] for s in starts[step]])
        x, y = window[:, :-1], window[:, 1:]
        for name, (cfg, model, opts, schedulers) in runs.items():
            opts.zero_grad()
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            exact = sum(p.grad.double().pow(2).sum() for p in model.parameters()).sqrt()
            t0 = time.perf_counter()
            norm = dist_utils.clip_grad_norm_(
                [p for p in model.parameters()], cfg.training.max_norm, foreach=True,
                pp_mesh=None, ep_enabled=False,
            )  # fmt: skip
            opts.step()
            t1 = time.perf_counter()
            schedulers.step()
            log[name]["loss"].append(loss.item())
            log[name]["grad_norm"].append(norm.item())
            log[name]["norm_rel_error"].append(abs(norm.item() / exact.item() - 1))
            log[name]["opt_s"].append(t1 - t0)
        print(f"{step + 1:>4} " + " ".join(
            f"{log[n]['loss'][-1]:>16.4f} {log[n]['grad_norm'][-1]:>16.4f}" for n in runs),
            flush=True)  # fmt: skip
    summary = {}
    for name, (_, model, opts, _) in runs.items():
        times = log[name]["opt_s"][1:]
        summary[name] = {
            "final_loss": log[name]["loss"][-1],
            "opt_ms_median": 1e3 * statistics.median(times),
            "opt_ms_min": 1e3 * min(times),
            "opt_ms_max": 1e3 * max(times),
            "state_bytes_per_param": state_bytes_per_param(model, opts),
            "grad_norm_max_rel_error_vs_fp64": max(log[name]["norm_rel_error"]),
        }
    print("\nrun          final loss  optimizer ms/step (median, min-max)  state bytes/param"
          "  grad_norm vs FP64 (max rel. error)")  # fmt: skip
    for name, s in summary.items():
        print(f"{name:<12} {s['final_loss']:>10.4f}  {s['opt_ms_median']:>8.1f} "
              f"({s['opt_ms_min']:.1f}-{s['opt_ms_max']:.1f}){'':>14} "
              f"{s['state_bytes_per_param']:>6.3f}  {s['grad_norm_max_rel_error_vs_fp64']:.1e}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "environment": environment(torch.device("cpu")),
                                         "log": log, "summary": summary}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
