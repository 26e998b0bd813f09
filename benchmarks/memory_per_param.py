"""Bytes per parameter element of a training step's parameter, gradient and every tensor
the optimizer keeps, measured from the tensors themselves (each storage counted once), for
a BF16 model under each of our state precisions and master kinds, beside torch's AdamW.

    .venv/bin/python benchmarks/memory_per_param.py [--elements 4M]
"""

from __future__ import annotations

import argparse

import torch

import ruda_torch


def measured(opt, params) -> float:
    tensors = [t for p in params for t in (p, p.grad)]
    for st in opt.state.values():
        tensors += [v for v in st.values() if isinstance(v, torch.Tensor)]
    for b in getattr(getattr(opt, "_plan", None), "buckets", None) or []:
        tensors += b.buffers  # the flat buckets the state entries view
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total / sum(p.numel() for p in params)


def run(dtype, make, n: int) -> float:
    params = [torch.nn.Parameter(torch.randn(n // 4).to(dtype)) for _ in range(4)]
    opt = make(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return measured(opt, params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", default="4M", help="parameter elements (default: 4M)")
    a = ap.parse_args(argv)
    n = int(float(a.elements.rstrip("M")) * 2**20) if a.elements.endswith("M") else int(a.elements)
    bf16 = torch.bfloat16
    rows = [("torch.optim.AdamW(fused=True), FP32 parameters", torch.float32,
             lambda ps: torch.optim.AdamW(ps, fused=True)),
            ("torch.optim.AdamW(fused=True), BF16 parameters (BF16 moments, no master)", bf16,
             lambda ps: torch.optim.AdamW(ps, fused=True))]  # fmt: skip
    for precision in ("fp32", "bf16", "8bit", "4bit"):
        for master in (False, True, "remainder"):
            rows.append((
                f"ours, BF16 parameters, state_precision={precision!r}, "
                f"master_weights={master!r}", bf16,
                lambda ps, pr=precision, m=master: ruda_torch.AdamW(
                    ps, fused_step=True, state_precision=pr, master_weights=m),
            ))  # fmt: skip
    print(f"# bytes per parameter element: parameter + gradient + optimizer state, "
          f"{n} elements in 4 tensors")  # fmt: skip
    print("| run | bytes per element |")
    print("|---|---|")
    for name, dtype, make in rows:
        print(f"| {name} | {run(dtype, make, n):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
