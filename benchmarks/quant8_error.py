#!/usr/bin/env python3
"""Quantization error of 8-bit moment codes on real AdamW moments (Note [8-bit moments] in
csrc/quant8.h).

A byte-level transformer language model (benchmarks/quality_state_precision.py) is
trained on the Python standard library's own sources with ruda_torch.AdamW (FP32
moments) for ``--steps`` steps; its moments (tensors of at least 4,096 elements, as the
8-bit format would hold them) are then coded in blocks of 256 with one FP32 scale (the
largest magnitude) per block, by each candidate code book:

  dyn        the dynamic-exponent map of bitsandbytes and torchao (signed for exp_avg,
             unsigned for exp_avg_sq; torchao's create_dynamic_map), nearest value
  s+EeMm     sign + e exponent bits + m mantissa bits, top binade [1, 2) (exp_avg)
  EeMm       e exponent bits + m mantissa bits (exp_avg_sq)
  ours       ruda_torch.ops.quantize_8bit: s+E3M4 and E4M4 (the native kernels), on the
             concatenated moments as the candidates above

and, for the blocking (Note [8-bit row blocks] in csrc/quant8.h), ours on each tensor:

  ours-flat  blocks of 256 of each tensor's flat elements (the earlier format)
  ours-rows  blocks of up to 256 elements of each row (this format: the optimizer's)

Reported: the relative error of the decoded moments (median, 99th percentile), the
fraction of nonzero values coded as zero, and the error of the update
m_hat / (sqrt(v_hat) + eps) computed from decoded moments against the exact one (relative
L2; the fraction of elements whose update grew more than 4x; the largest update).

``--bits 4``: the candidates of 4-bit code books instead (16 codes), each in blocks of 128
of the flat tensor (torchao's), of 128 and of 256 elements of each row, and for the second
moment rank-1 normalization (each element scaled by the smaller of its row's and its
column's maximum: Li, Chen and Zhu, "Memory Efficient Optimizers with 4-bit States"):
torchao's AdamW4bit maps (a signed dynamic map with 3 exponent bits; linear without zero),
signed linear k/7 and its square, small float codes scaled to a largest value of 1
(sign + E2M1, sign + E3M0; E3M1, E2M2 without zero), powers of two (E4M0) and their
squares; then each moment's error alone in the update and pairs of them.

    .venv/bin/python benchmarks/quant8_error.py --steps 300
    .venv/bin/python benchmarks/quant8_error.py --steps 300 --bits 4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality_state_precision as quality  # noqa: E402
from bench_adamw import environment  # noqa: E402

import ruda_torch  # noqa: E402
from ruda_torch import ops  # noqa: E402

BLOCK = ops.BLOCK_8BIT


def float_code(exponent_bits: int, mantissa_bits: int, signed: bool) -> torch.Tensor:
    """Every value of a float code with top binade [1, 2), sorted (FP64)."""
    top = 2**exponent_bits - 1
    values = {0.0}
    for e in range(2**exponent_bits):
        for f in range(2**mantissa_bits):
            if e == 0:
                values.add(2.0 ** (1 - top) * f / 2**mantissa_bits)
            else:
                values.add(2.0 ** (e - top) * (1 + f / 2**mantissa_bits))
    if signed:
        values |= {-v for v in values}
    return torch.tensor(sorted(values), dtype=torch.float64)


def nearest(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    i = torch.searchsorted(table, x).clamp(1, len(table) - 1)
    lo, hi = table[i - 1], table[i]
    return torch.where((x - lo) <= (hi - x), lo, hi)


def blockwise(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (FP64) coded by `table` in blocks of BLOCK with absmax scales, decoded."""
    n = x.numel()
    rows = torch.cat([x, x.new_zeros(-n % BLOCK)]).view(-1, BLOCK)
    scale = rows.abs().amax(1, keepdim=True)
    q = (rows / torch.where(scale > 0, scale, 1.0)).clamp(table[0].item(), table[-1].item())
    return (nearest(q.flatten(), table).view_as(rows) * scale).flatten()[:n]


def ours(x: torch.Tensor, code: str) -> torch.Tensor:
    codes, scales = ops.quantize_8bit(x.float(), code)
    return ops.dequantize_8bit(codes, scales, code).double()


def ours_per_tensor(moments: list[torch.Tensor], code: str, rows: bool) -> torch.Tensor:
    """Each tensor coded by ours on its own (by its rows, or flat), decoded, concatenated."""
    out = []
    for x in moments:
        x32 = x.float() if rows else x.float().flatten()
        codes, scales = ops.quantize_8bit(x32, code)
        out.append(ops.dequantize_8bit(codes, scales, code).double().flatten())
    return torch.cat(out)


def trained_moments(steps: int, seed: int):
    train, _, _, _ = quality.corpus(2_000_000)
    torch.manual_seed(seed)
    model = quality.ByteLM(128)
    opt = ruda_torch.AdamW(model.parameters(), **quality.HYPER, fused_step=True)
    for step, (x, y) in enumerate(quality.batches(train, steps, 16, 128, seed + 7)):
        loss = nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % max(1, steps // 5) == 0:
            print(f"  training: step {step + 1}/{steps}, loss {loss.item():.4f}", flush=True)
    big = [p for p in model.parameters() if p.numel() >= 4096]
    ms = [opt.state[p]["exp_avg"].detach().double().contiguous() for p in big]
    vs = [opt.state[p]["exp_avg_sq"].detach().double().contiguous() for p in big]
    shapes = sorted({tuple(p.shape) for p in big})
    print(f"  tensors of >= 4096 elements: {len(big)}, shapes {shapes}")
    return ms, vs, steps


def report_moments(first: dict, second: dict, m, v, width: int) -> None:
    """Each candidate's decoded moments against the exact ones: relative error of the
    nonzero values (median, 99th percentile) and the fraction of them coded as zero."""

    def report(name, decoded, exact_values):
        nz = exact_values != 0
        rel = (decoded[nz] - exact_values[nz]).abs() / exact_values[nz].abs()
        zeroed = ((decoded == 0) & nz).double().mean().item()
        p99 = rel.kthvalue(max(1, int(0.99 * rel.numel()))).values.item()
        print(f"  {name:{width}s} median {rel.median().item():.4f}  p99 {p99:.4f}  "
              f"coded as 0 {zeroed:.5f}")  # fmt: skip

    print("exp_avg, relative error of nonzero values:")
    for k, d in first.items():
        report(k, d, m)
    print("exp_avg_sq:")
    for k, d in second.items():
        report(k, d, v)


# ---------------------------------------------------------------------------- 4 bits


def table4(name: str) -> torch.Tensor:
    """The 16 (or 15) values of a 4-bit code book, sorted (FP64); largest 1."""
    if name == "ao-dyn":  # torchao's AdamW4bit, exp_avg: signed dynamic map, 3 exponent bits
        from torchao.optim.quant_utils import create_dynamic_map

        return torch.tensor(sorted(create_dynamic_map(True, 3, 4)), dtype=torch.float64)
    if name == "ao-lin":  # torchao's AdamW4bit, exp_avg_sq: linear without zero
        return torch.linspace(0, 1, 17, dtype=torch.float64)[1:]
    if name == "lin7":  # signed linear, k / 7
        return torch.arange(-7, 8, dtype=torch.float64) / 7
    if name == "lin-sqrt":  # signed, k / 7 squared: finer near zero
        k = torch.arange(-7, 8, dtype=torch.float64) / 7
        return k.abs().pow(2) * k.sign()
    if name in ("s+E2M1", "E3M1", "E2M2"):
        signed = name.startswith("s+")
        e, m = int(name[-3]), int(name[-1])
        t = float_code(e, m, signed)
        t = t / t.abs().max()
        return t if signed else t[t > 0]  # unsigned: no zero
    if name == "s+E3M0":
        mags = [0.0] + [2.0**-k for k in range(6, -1, -1)]
        return torch.tensor(sorted({*mags, *(-x for x in mags)}), dtype=torch.float64)
    if name == "E4M0":  # powers of two 2^-15 .. 1, no zero
        return torch.tensor([2.0**-k for k in range(15, -1, -1)], dtype=torch.float64)
    if name == "E4M0-sqrt":  # 4^-k: sqrt(v) at powers of two 2^-15 .. 1
        return torch.tensor([4.0**-k for k in range(15, -1, -1)], dtype=torch.float64)
    raise ValueError(name)


def coded(x: torch.Tensor, table: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale coded by `table` (nearest value, clamped), decoded."""
    q = (x / torch.where(scale > 0, scale, 1.0)).clamp(table[0].item(), table[-1].item())
    return nearest(q.flatten(), table).view_as(q) * scale


def by_blocks(x: torch.Tensor, table: torch.Tensor, block: int, rows: bool) -> torch.Tensor:
    """x coded in blocks of `block` (of each row, or of the flat tensor) with absmax scales."""
    if not rows or x.dim() < 2:
        flat = x.flatten()
        n = flat.numel()
        b = torch.cat([flat, flat.new_zeros(-n % block)]).view(-1, block)
        return coded(b, table, b.abs().amax(1, keepdim=True)).flatten()[:n]
    r = x.reshape(x.shape[0], -1)
    c = r.shape[1]
    padded = torch.cat([r, r.new_zeros(r.shape[0], -c % block)], 1).view(r.shape[0], -1, block)
    out = coded(padded, table, padded.abs().amax(2, keepdim=True))
    return out.view(r.shape[0], -1)[:, :c].flatten()


def rank1(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """x (>= 0) coded with rank-1 normalization: each element scaled by the smaller of its
    row's and its column's maximum (Li, Chen, Zhu 2023); 1-D tensors by blocks of 128."""
    if x.dim() < 2:
        return by_blocks(x, table, 128, False)
    r = x.reshape(x.shape[0], -1)
    scale = torch.minimum(r.amax(1, keepdim=True), r.amax(0, keepdim=True))
    return coded(r, table, scale).flatten()


def main4(ms, vs, m, v, update) -> int:
    """The 4-bit candidates (``--bits 4``) on moments ``ms``, ``vs`` (concatenated: m, v)."""
    exact = update(m, v)
    first, second = {}, {}
    for code in ("ao-dyn", "lin7", "lin-sqrt", "s+E2M1", "s+E3M0"):
        for block, rows in ((128, False), (128, True), (256, True)):
            first[f"{code} {'rows' if rows else 'flat'}{block}"] = torch.cat(
                [by_blocks(x, table4(code), block, rows) for x in ms]
            )
    for code in ("ao-lin", "E4M0", "E4M0-sqrt", "E3M1", "E2M2"):
        for block, rows in ((128, False), (128, True), (256, True)):
            second[f"{code} {'rows' if rows else 'flat'}{block}"] = torch.cat(
                [by_blocks(x, table4(code), block, rows) for x in vs]
            )
        second[f"{code} rank1"] = torch.cat([rank1(x, table4(code)) for x in vs])

    report_moments(first, second, m, v, width=22)
    print("update from decoded moments (exp_avg with exact exp_avg_sq, exp_avg_sq with exact")
    print("exp_avg, then pairs): relative L2 error, fraction grown > 4x, largest |update|")
    print(f"  exact: largest |update| {exact.abs().max().item():.3g}")

    def row(label, u):
        err = ((u - exact).norm() / exact.norm()).item()
        grown = (u.abs() > 4 * exact.abs() + 1e-3).double().mean().item()
        print(f"  {label:48s} {err:.4f}  {grown:.6f}  {u.abs().max().item():.3g}")

    for k, d in first.items():
        row(f"exp_avg {k}", update(d, v))
    for k, d in second.items():
        row(f"exp_avg_sq {k}", update(m, d))
    pairs = [("ao-dyn flat128", "ao-lin flat128"), ("ao-dyn flat128", "ao-lin rank1")]
    best_m = min(first, key=lambda k: (update(first[k], v) - exact).norm().item())
    best_v = min(second, key=lambda k: (update(m, second[k]) - exact).norm().item())
    pairs += [
        (best_m, best_v),
        ("s+E2M1 rows128", "E2M2 rows128"),
        ("s+E2M1 rows256", "E2M2 rows256"),
        ("s+E2M1 rows128", "E3M1 rows128"),
        ("s+E2M1 rows128", "ao-lin rows128"),
        ("ao-dyn flat128", "E2M2 rows128"),
        ("lin7 rows128", "E4M0 rows128"),
    ]
    for a, b in pairs:
        row(f"{a} + {b}", update(first[a], second[b]))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bits", type=int, choices=(8, 4), default=8,
                    help="the candidates of 8-bit or of 4-bit code books")  # fmt: skip
    args = ap.parse_args(argv)
    env = environment(torch.device("cpu"))
    print(f"quant8_error: torch {env['torch']}, CPU {env.get('cpu_model')}")
    ms, vs, t = trained_moments(args.steps, args.seed)
    m = torch.cat([x.flatten() for x in ms])
    v = torch.cat([x.flatten() for x in vs])
    b1, b2, eps = quality.HYPER["betas"][0], quality.HYPER["betas"][1], quality.HYPER["eps"]
    bc1, bc2 = 1 - b1**t, 1 - b2**t

    def update(mm, vv):
        return (mm / bc1) / ((vv / bc2).sqrt() + eps)

    print(f"moments after {t} steps: {m.numel():,} elements in tensors of >= 4096")
    if args.bits == 4:
        return main4(ms, vs, m, v, update)
    exact = update(m, v)
    first, second = {}, {}
    try:
        from torchao.optim.quant_utils import create_dynamic_map

        first["dyn"] = blockwise(m, torch.tensor(create_dynamic_map(True), dtype=torch.float64))
        second["dyn"] = blockwise(v, torch.tensor(create_dynamic_map(False), dtype=torch.float64))
    except ImportError:
        print("(torchao is not installed: no dynamic map; pip install -r requirements-bench.txt)")
    for e, mm in ((4, 3), (3, 4), (5, 2)):
        first[f"s+E{e}M{mm}"] = blockwise(m, float_code(e, mm, True))
    for e, mm in ((4, 4), (5, 3), (3, 5)):
        second[f"E{e}M{mm}"] = blockwise(v, float_code(e, mm, False))
    first["ours"], second["ours"] = ours(m, "signed"), ours(v, "unsigned")
    for name, rows in (("ours-flat", False), ("ours-rows", True)):
        first[name] = ours_per_tensor(ms, "signed", rows)
        second[name] = ours_per_tensor(vs, "unsigned", rows)

    report_moments(first, second, m, v, width=10)
    print("update from decoded moments: relative L2 error, fraction grown > 4x, largest |update|")
    print(f"  exact: largest |update| {exact.abs().max().item():.3g}")
    pairs = [("dyn", "dyn")] if "dyn" in first else []
    pairs += [
        ("s+E4M3", "E4M4"),
        ("s+E3M4", "E5M3"),
        ("s+E3M4", "E3M5"),
        ("ours", "ours"),
        ("ours-flat", "ours-flat"),
        ("ours-rows", "ours-rows"),
    ]
    for a, b in pairs:
        u = update(first[a], second[b])
        err = ((u - exact).norm() / exact.norm()).item()
        grown = (u.abs() > 4 * exact.abs() + 1e-3).double().mean().item()
        print(f"  exp_avg {a:8s} exp_avg_sq {b:6s} {err:.4f}  {grown:.6f}  "
              f"{u.abs().max().item():.3g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
