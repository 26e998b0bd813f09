"""benchmarks/emulated_4bit.py, the study of the 4-bit codes' rounding: its nearest rounding
is the kernels' (so what it measures in training is what the kernels do), its stochastic
rounding is unbiased, and the second moment's drift it was written to show
(docs/performance.md, "The second moment's drift")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import emulated_4bit as emu  # noqa: E402

import ruda_torch  # noqa: E402
from ruda_torch import ops  # noqa: E402


def spread(shape, seed):
    """Values over many binades, some blocks holding zeros: every code of both books."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(3 * torch.randn(shape, generator=g))
    x.view(-1)[::7] = 0.0
    x.view(-1)[:128] = 0.0  # a whole block of zeros (scale 0)
    return x


@pytest.mark.parametrize("shape", [(3, 300), (1026,), (64, 256), (5, 130), (97, 2)])
def test_nearest_codes_are_the_kernels(shape):
    """Flat blocks, rows not whole blocks, a 1-D tensor: the same decoded values, bit for bit,
    as ruda_torch.ops.quantize_4bit / dequantize_4bit (the step's codes)."""
    x = spread(shape, seed=len(shape) * 1000 + shape[0])
    for table, code, values in ((emu.SIGNED, "signed", x), (emu.UNSIGNED, "unsigned", x.abs())):
        kernels = ops.dequantize_4bit(*ops.quantize_4bit(values, code), code)
        ours = emu.code(values, table, "nearest")
        assert torch.equal(ours.view(torch.int32), kernels.view(torch.int32)), code


def test_nearest_steps_follow_the_kernels_step():
    """30 steps against ruda_torch.AdamW(state_precision="4bit"): the same codes at every
    step, so the parameters stay within the FP32 step's rounding of each other (a code of
    a different value would move a parameter by about lr)."""
    g = torch.Generator().manual_seed(1)
    shapes = [(64, 200), (4098,)]
    start = [torch.randn(s, generator=g) for s in shapes]
    kernels = [p.clone().requires_grad_() for p in start]
    emulated = [p.clone().requires_grad_() for p in start]
    hyper = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    opt_k = ruda_torch.AdamW(kernels, **hyper, state_precision="4bit", fused_step=True)
    opt_e = emu.Emulated4bit(emulated, **hyper)
    for step in range(30):
        for a, b in zip(kernels, emulated, strict=True):
            grad = torch.randn(a.shape, generator=g) * (1 + step)
            a.grad, b.grad = grad.clone(), grad.clone()
        opt_k.step()
        opt_e.step()
        for a, b in zip(kernels, emulated, strict=True):
            assert (a - b).abs().max().item() < 1e-6, step


def test_stochastic_rounding_is_unbiased():
    """Each value codes as one of the two codes around it, the upper one with probability
    its distance from the lower over the spacing: the decoded mean over many draws is the
    value. Rounding to nearest is not: these values lie just above a code."""
    rows = 4000
    for table in (emu.SIGNED, emu.UNSIGNED):
        positive = table[table > 0]
        points = (positive[:-1] + 0.2 * (positive[1:] - positive[:-1]))[:16]
        x = torch.zeros(rows, 128)
        x[:, 0] = 1.0  # each row is one block, of scale 1
        x[:, 1 : 1 + points.numel()] = points
        gen = torch.Generator().manual_seed(5)
        out = emu.code(x, table, "stochastic", gen)[:, 1 : 1 + points.numel()]
        i = torch.bucketize(points, table)
        assert bool(((out == table[i - 1]) | (out == table[i])).all())
        spacing = table[i] - table[i - 1]
        # 4000 draws: the mean's standard deviation is at most spacing * 0.4 / sqrt(4000)
        assert bool(((out.mean(0) - points).abs() < 0.03 * spacing).all())
        nearest = emu.code(x[:1], table, "nearest")[0, 1 : 1 + points.numel()]
        assert bool((nearest < points).all())
    with pytest.raises(ValueError, match="rounding"):
        emu.code(x, emu.SIGNED, "up")


def test_nearest_rounding_stalls_the_second_moment():
    """With beta2 = 0.999 a step moves v by 0.1% of the gradient's square, far below half
    the spacing of the codes: rounded to nearest, v stays on its code. Half of each block's
    gradients grow 2.5x after step 100, half shrink 2.5x (each block's largest stays, so
    the scales do not move): after 1000 steps the coded v of the growing ones is 0.15x
    the exact running average, of the shrinking ones 4.7x. Rounded stochastically, both
    are the exact one on average."""
    ratios = {}
    for rounding in emu.ROUNDINGS:
        torch.manual_seed(0)
        p = torch.zeros(16, 256, requires_grad=True)  # 4096 elements: coded
        opt = emu.Emulated4bit([p], lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                               rounding_exp_avg=rounding, rounding_exp_avg_sq=rounding, seed=3)  # fmt: skip
        exact = torch.zeros(16, 256, dtype=torch.float64)
        grow = torch.arange(256) % 2 == 1
        grow[::128] = False
        shrink = ~grow
        shrink[::128] = False
        for step in range(1000):
            g = torch.full((16, 256), 0.5 if step < 100 else 0.2)
            g[:, grow] = 0.2 if step < 100 else 0.5
            g[:, ::128] = 1.0
            g *= torch.where(torch.rand(16, 256) < 0.5, -1.0, 1.0)
            p.grad = g
            exact.mul_(0.999).addcmul_(g.double(), g.double(), value=0.001)
            opt.step()
        v = opt.state[p]["exp_avg_sq"].double()
        ratios[rounding] = [(v[:, s].mean() / exact[:, s].mean()).item() for s in (grow, shrink)]
    assert ratios["nearest"][0] < 0.3 and ratios["nearest"][1] > 3, ratios
    assert all(0.9 < r < 1.1 for r in ratios["stochastic"]), ratios


def test_quality_benchmark_measures_the_drift(tmp_path):
    """benchmarks/quality_state_precision.py --drift: the FP32 run's moments are the exact
    ones, the emulated 4-bit run's are not; an unknown run name is refused, not run."""
    bench = [sys.executable, str(ROOT / "benchmarks" / "quality_state_precision.py")]
    small = ["--steps", "10", "--batch", "2", "--context", "32", "--max-bytes", "400000",
             "--val-windows", "8"]  # fmt: skip
    out = tmp_path / "q.json"
    run = subprocess.run([*bench, *small, "--runs", "fp32,emu4_nearest", "--drift", "--json",
                          str(out)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = json.loads(out.read_text())["results"]
    fp32 = results["fp32"]["per_seed"][0]["drift"]
    emulated = results["emu4_nearest"]["per_seed"][0]["drift"]
    assert [d["step"] for d in fp32] == list(range(1, 11))
    assert all(abs(d["v_ratio_median"] - 1) < 1e-5 and d["update_error"] < 1e-4 for d in fp32), fp32
    assert emulated[-1]["update_error"] > 0.05
    assert "exp_avg_sq / exact" in run.stdout
    bad = subprocess.run([*bench, *small, "--runs", "fp32,emu4_stochastik"],
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert bad.returncode == 2 and "unknown run 'emu4_stochastik'" in bad.stderr
