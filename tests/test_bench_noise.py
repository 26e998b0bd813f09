"""The benchmarks say when their numbers are not trustworthy (Note [Noise flags] in
benchmarks/bench_adamw.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_adamw  # noqa: E402


def test_busy_load_average_is_named():
    assert bench_adamw._busy(None) is None
    assert bench_adamw._busy(["0.0", "0.0", "0.0"]) is None
    assert "load average 1000.0" in bench_adamw._busy(["1000.0", "1.0", "1.0"])


def test_a_spread_above_the_limit_flags_the_variant_and_the_run(tmp_path):
    """With --max-spread 1.0 any two batches that differ flag their variant: the case
    lists it, a WARNING names it, and the record keeps it."""
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_adamw.py"), "--elements", "20000",
         "--tensors", "4", "--samples", "4", "--iterations", "1", "--warmup", "1",
         "--no-many-small", "--variants", "ours_fused,torch_fused", "--max-spread", "1.0",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    record = json.loads(out.read_text())
    (case,) = record["cases"]
    assert case["noisy_variants"], "four batches of identical timing are not plausible"
    assert "WARNING: the batches of" in run.stdout
    assert "WARNING: noisy run" in run.stdout
    assert record["noisy_cases"] == {case["case"]: case["noisy_variants"]}
    assert "load average before" in run.stdout
