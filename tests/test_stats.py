"""The gradient-statistics operators and the reduction plan, on the CPU kernels.

- ``StatsPlan``: the worked values of docs/design.md section 3 and the rejected row counts.
- ``analyze_gradient``, ``merge_gradient_stats``, ``merge_gradient_stats_chunks``:
  bitwise against a NumPy FP32 emulation of Note [Canonical reduction order]
  (csrc/grad_stats.h), written here from the Note alone, and close to FP64 statistics.
  The CUDA kernels follow the same header, so bitwise agreement with the emulation here
  is what makes the CPU/CUDA parity test of tests/test_gpu_ops.py meaningful.
- Non-finite handling, accuracy of the global norm at scale, thread-count
  independence, gradients never written, bad inputs rejected with nothing changed,
  and ``torch.library.opcheck`` for the three operators.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from threads import with_threads

import ruda_torch
from ruda_torch import ops
from ruda_torch.reference import global_norm_reference

CHUNK = 4096  # gradient elements per statistics row (kStatsChunk)
ROW_LANES = 32  # lanes of an analyze row (kRowLanes)
MERGE_LANES = 256  # lanes of a merge output row (kMergeLanes)
FAN_IN = 1024  # rows per merge output row (kMergeFanIn)
F32 = np.float32

GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# Tolerances of FP32 statistics against FP64 ones, each with its reason.
# sum_sq of one row: every element's square is rounded once (after the unscale, rounded
# once), each lane adds 128 squares in sequence and the halving tree adds 5 levels; all
# terms are non-negative, so the relative error is at most (2 + 128 + 5) roundings of
# 2**-24 each (the classical bound for recursive summation of non-negative terms).
ROW_SUM_RTOL = (2 + CHUNK // ROW_LANES + 5) * 2.0**-24
# max_abs: the maximum itself is exact; only the unscale (stored * fp32(1/scale))
# rounds, twice at most (the reciprocal, then the product).
ROW_MAX_RTOL = 2 * 2.0**-24
# The global norm over ~3M elements (733 rows, one merge level: 4 sequential adds per
# lane, then the tree). sqrt halves the relative error of the sum. The worst case of the
# recursive-summation argument is (2 + 128 + 5 + 4 + 8) / 2 * 2**-24 ~ 4.4e-6, reached
# only when every rounding errs the same way; rounding errors of random signs stay far
# below it (measured up to ~7e-8), and design.md's acceptance figure is 2e-6.
NORM_RTOL = 2e-6
# 8M elements, 2048 rows: two merge levels (a worst case of ~4.8e-6 by the same
# argument; measured up to ~7e-8), design.md's
# acceptance figure for the multi-level case is 1e-5.
NORM_RTOL_TWO_LEVELS = 1e-5


# --------------------------------------------------------------------------- StatsPlan

PLAN_ROWS = [
    # (rows, levels, scratch_elements)
    (1, [], 0),
    (1024, [], 0),
    (1025, [2], 6),
    (2048, [2], 6),
    (1024 * 1024, [1024], 3072),
    (1024 * 1024 + 1, [1025, 2], 3081),
    (4_194_304, [4096, 4], 12_300),
]


@pytest.mark.parametrize("rows,levels,scratch", PLAN_ROWS, ids=[str(r[0]) for r in PLAN_ROWS])
def test_stats_plan_levels(rows, levels, scratch):
    plan = ruda_torch.StatsPlan(rows)
    assert plan.rows == rows
    assert plan.levels == levels
    assert plan.scratch_elements == scratch
    assert plan.scratch_bytes == 4 * scratch


def test_stats_plan_maximum_is_49200_bytes():
    assert ruda_torch.StatsPlan(4_194_304).scratch_bytes == 49_200


@pytest.mark.parametrize("rows", [0, -1, 4_194_305, 1.5, True, "3", None])
def test_stats_plan_rejects(rows):
    with pytest.raises(ValueError, match="StatsPlan rows must be"):
        ruda_torch.StatsPlan(rows)


def test_stats_plan_reduce_checks_its_buffers():
    plan = ruda_torch.StatsPlan(1025)
    out = torch.zeros(3)
    with pytest.raises(ValueError, match=r"rows must have shape \(1025, 3\)"):
        plan.reduce(torch.zeros(1024, 3), torch.zeros(6), out)
    with pytest.raises(ValueError, match="scratch holds 5 elements, the plan needs 6"):
        plan.reduce(torch.zeros(1025, 3), torch.zeros(5), out)
    assert torch.equal(out, torch.zeros(3))


# ------------------------------------------------- NumPy emulation of the canonical order


def _tree(s: np.ndarray, m: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The halving tree over the last axis: for s = L/2, ..., 1, lane i (i < s) =
    combine(lane i, lane i + s). Returns [..., 3] rows."""
    width = s.shape[-1] // 2
    while width > 0:
        lo, hi = slice(0, width), slice(width, 2 * width)
        s[..., lo] = s[..., lo] + s[..., hi]
        m[..., lo] = np.where(m[..., lo] > m[..., hi], m[..., lo], m[..., hi])
        c[..., lo] = c[..., lo] + c[..., hi]
        width //= 2
    return np.stack([s[..., 0], m[..., 0], c[..., 0]], axis=-1).astype(F32)


def _lanes_add(s, m, c, x) -> None:
    """One step of the lanes: x[..., j] is lane j's next element (non-finite ones only
    counted)."""
    finite = (x - x) == F32(0.0)
    s[...] = np.where(finite, s + x * x, s)
    ax = np.abs(x)
    m[...] = np.where(finite & (ax > m), ax, m)
    c[...] = np.where(finite, c, c + F32(1.0))


def emulate_analyze(grad: torch.Tensor, grad_scale: float | None) -> np.ndarray:
    """Rows of one tensor as the Note defines them: g = stored * fp32(1 / scale); lane j
    takes elements j, j + 32, ... of its row in order (non-finite ones only counted);
    then the halving tree. Every NumPy operation here is one FP32 rounding. Full rows
    run side by side (axis 0); a short last row runs alone with its lanes stopping where
    the data does (no padding: the kernels' padding claim is checked, not assumed)."""
    flat = grad.detach().reshape(-1).to(torch.float32).numpy()  # exact for fp16/bf16
    with np.errstate(all="ignore"):  # a scale of 0 or NaN is tested too
        inv = F32(1.0) / F32(grad_scale) if grad_scale is not None else F32(1.0)
    full = flat.size // CHUNK
    out = []
    with np.errstate(all="ignore"):
        g = (flat[: full * CHUNK] * inv).reshape(full, CHUNK // ROW_LANES, ROW_LANES)
        s, m, c = (np.zeros((full, ROW_LANES), F32) for _ in range(3))
        for r in range(CHUNK // ROW_LANES):
            _lanes_add(s, m, c, g[:, r, :])
        out.append(_tree(s, m, c))
        tail = flat[full * CHUNK :] * inv
        if tail.size:
            s, m, c = (np.zeros(ROW_LANES, F32) for _ in range(3))
            for r in range(0, tail.size, ROW_LANES):
                x = tail[r : r + ROW_LANES]
                n = x.size
                _lanes_add(s[:n], m[:n], c[:n], x)  # views: the lanes past n stop
            out.append(_tree(s, m, c)[None])
    return np.concatenate(out).astype(F32).reshape(-1, 3)


def emulate_merge(rows: np.ndarray) -> np.ndarray:
    """merge_gradient_stats: output row k from input rows [1024k, 1024(k+1)); lane j
    takes rows j, j + 256, j + 512, j + 768 in order, starting from a zero row."""
    out = []
    with np.errstate(all="ignore"):
        for first in range(0, rows.shape[0], FAN_IN):
            block = rows[first : first + FAN_IN]
            s = np.zeros(MERGE_LANES, F32)
            m = np.zeros(MERGE_LANES, F32)
            c = np.zeros(MERGE_LANES, F32)
            for r in range(0, block.shape[0], MERGE_LANES):
                x = block[r : r + MERGE_LANES]
                n = x.shape[0]
                s[:n] = s[:n] + x[:, 0]
                m[:n] = np.where(m[:n] > x[:, 1], m[:n], x[:, 1])
                c[:n] = c[:n] + x[:, 2]
            out.append(_tree(s, m, c))
    return np.array(out, dtype=F32).reshape(-1, 3)


def emulate_chunks(reports: np.ndarray) -> np.ndarray:
    """merge_gradient_stats_chunks: a left fold from a zero row, in the order given."""
    acc = np.zeros(3, F32)
    for r in reports:
        acc = np.array([acc[0] + r[0], acc[1] if acc[1] > r[1] else r[1], acc[2] + r[2]], F32)
    return acc


# ----------------------------------------------------------------------------- helpers


def run_analyze(grads: list[torch.Tensor], grad_scale: float | None = None) -> torch.Tensor:
    device = grads[0].device if grads else torch.device("cpu")
    n_rows = sum(ops.stats_rows_for(g.numel()) for g in grads)
    rows = torch.full((n_rows, 3), float("nan"), device=device)
    scale = None
    if grad_scale is not None:
        scale = torch.tensor([grad_scale], dtype=torch.float32, device=device)
    ops.analyze_gradient(grads, rows, scale)
    return rows


def run_merge(rows: torch.Tensor) -> torch.Tensor:
    out = torch.full((-(-rows.shape[0] // FAN_IN), 3), float("nan"), device=rows.device)
    ops.merge_gradient_stats(rows, out)
    return out


def random_grad(gen: torch.Generator, numel: int, dtype: torch.dtype, scale: float = 1.0):
    """Values spread over several orders of magnitude (times `scale`, as a loss scaler
    would store them), converted to `dtype`."""
    magnitude = torch.pow(10.0, torch.empty(numel).uniform_(-5, 0, generator=gen))
    return (torch.randn(numel, generator=gen) * magnitude * scale).to(dtype)


def seed_of(*parts) -> int:
    """A seed that is stable across processes (unlike hash() of a str)."""
    return zlib.crc32(repr(parts).encode())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads and signed zeros included)."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def assert_bitwise(actual: torch.Tensor, expected: np.ndarray, what: str):
    a = actual.detach().numpy().astype(F32)
    assert a.shape == expected.shape, f"{what}: shape {a.shape} vs {expected.shape}"
    same = a.view(np.uint32) == expected.view(np.uint32)
    if not same.all():
        where = np.argwhere(~same)[0]
        raise AssertionError(
            f"{what}: {int((~same).sum())} values differ from the canonical-order emulation; "
            f"first at {tuple(where)}: kernel {a[tuple(where)]!r} vs emulation "
            f"{expected[tuple(where)]!r}"
        )


# ------------------------------------------------------------------- analyze_gradient

SIZES = [0, 1, 255, 257, 4095, 4096, 4097, 10_000, 3 * CHUNK + 100]


def test_analyze_row_count_is_sum_of_ceil():
    grads = [torch.randn(n) for n in SIZES]
    rows = run_analyze(grads)
    assert rows.shape == (sum(math.ceil(n / CHUNK) for n in SIZES), 3)
    assert rows.shape[0] == 0 + 1 + 1 + 1 + 1 + 1 + 2 + 3 + 4


ANALYZE_CASES = [
    # (dtype, grad_scale)
    (torch.float32, None),
    (torch.float32, 1024.0),
    (torch.float32, 3.0),
    (torch.float16, None),
    (torch.float16, 8192.0),
    (torch.float16, 0.75),
    (torch.bfloat16, None),
    (torch.bfloat16, 7.0),
]


@pytest.mark.parametrize(
    "dtype,grad_scale", ANALYZE_CASES, ids=[f"{d}-{s}" for d, s in ANALYZE_CASES]
)
def test_analyze_matches_canonical_emulation_bitwise(dtype, grad_scale):
    gen = torch.Generator().manual_seed(seed_of("bitwise", str(dtype), grad_scale))
    scale = 1.0 if grad_scale is None else grad_scale
    grads = [random_grad(gen, n, dtype, scale) for n in SIZES]
    rows = run_analyze(grads, grad_scale)
    expected = np.concatenate([emulate_analyze(g, grad_scale) for g in grads])
    assert_bitwise(rows, expected, f"analyze_gradient rows ({dtype}, scale {grad_scale})")


@pytest.mark.parametrize(
    "dtype,grad_scale", ANALYZE_CASES, ids=[f"{d}-{s}" for d, s in ANALYZE_CASES]
)
def test_analyze_rows_close_to_fp64(dtype, grad_scale):
    gen = torch.Generator().manual_seed(seed_of("fp64", str(dtype), grad_scale))
    scale = 1.0 if grad_scale is None else grad_scale
    grads = [random_grad(gen, n, dtype, scale) for n in SIZES]
    rows = run_analyze(grads, grad_scale).double()
    r = 0
    for g in grads:
        for start in range(0, g.numel(), CHUNK):
            chunk = g[start : start + CHUNK]
            sum_sq, max_abs, nonfinite = global_norm_reference(chunk, scale)
            got = rows[r]
            assert abs(got[0].item() - sum_sq) <= ROW_SUM_RTOL * sum_sq, (
                f"row {r}: sum_sq {got[0].item()!r} vs FP64 {sum_sq!r}"
            )
            assert abs(got[1].item() - max_abs) <= ROW_MAX_RTOL * max_abs, (
                f"row {r}: max_abs {got[1].item()!r} vs FP64 {max_abs!r}"
            )
            assert got[2].item() == nonfinite == 0
            r += 1
    assert r == rows.shape[0]


def test_analyze_power_of_two_scale_max_is_exact():
    gen = torch.Generator().manual_seed(11)
    g = random_grad(gen, 5000, torch.float16, 2.0**12)
    rows = run_analyze([g], 2.0**12)
    for k, start in enumerate(range(0, 5000, CHUNK)):
        expected = g[start : start + CHUNK].float().abs().max().item() / 2.0**12
        assert rows[k, 1].item() == expected


# --------------------------------------------------------------------- non-finite values

NONFINITE_CASES = [
    # (id, dtype, grad_scale, {index: value}, expected nonfinite count)
    ("nan", torch.float32, None, {3: float("nan")}, 1),
    ("pos_inf", torch.float32, None, {4095: float("inf")}, 1),
    ("neg_inf", torch.float32, None, {4096: float("-inf")}, 1),
    ("all_three", torch.float32, 2.0, {0: float("nan"), 300: float("inf"), 9000: -math.inf}, 3),
    ("fp16_nan_inf", torch.float16, 1024.0, {17: float("nan"), 5000: float("-inf")}, 2),
    ("bf16_inf", torch.bfloat16, None, {256: float("inf"), 512: float("inf")}, 2),
    # Finite stored values whose unscaled value overflows FP32: non-finite gradients.
    ("fp32_overflow_unscaled", torch.float32, 0.5, {10: 3.0e38}, 1),
    ("fp16_max_overflow_unscaled", torch.float16, 2.0**-120, {20: 65504.0}, 1),
]


@pytest.mark.parametrize(
    "dtype,grad_scale,inject,count",
    [c[1:] for c in NONFINITE_CASES],
    ids=[c[0] for c in NONFINITE_CASES],
)
def test_nonfinite_counted_and_excluded(dtype, grad_scale, inject, count):
    gen = torch.Generator().manual_seed(5)
    scale = 1.0 if grad_scale is None else grad_scale
    # Small finite values (times the scale) so that only the injected ones overflow.
    g = (torch.rand(10_000, generator=gen) * 0.5 * min(scale, 1.0)).to(dtype)
    clean = g.clone()
    for i, v in inject.items():
        g[i] = v
        clean[i] = 0.0
    rows = run_analyze([g], grad_scale)
    report = torch.zeros(3)
    ops.merge_gradient_stats_chunks(run_merge(rows), report)
    clean_report = torch.zeros(3)
    ops.merge_gradient_stats_chunks(run_merge(run_analyze([clean], grad_scale)), clean_report)
    # A zero contributes nothing to sum or max, so the clean tensor gives the same bits.
    assert report[2].item() == count
    assert torch.equal(report[:2], clean_report[:2]), (report, clean_report)
    assert clean_report[2].item() == 0
    assert torch.isfinite(report).all()
    assert_bitwise(rows, emulate_analyze(g, grad_scale), "rows with non-finite values")


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=DTYPE_IDS)
def test_finite_values_whose_squares_overflow(dtype):
    """A finite gradient whose square overflows makes its row's sum inf with no non-finite
    count. The CPU kernel reads full rows on the assumption that all is finite and
    redoes a row whose sum is not finite; this must give the canonical bits in full and
    short rows, with and without a scale, and count nothing."""
    gen = torch.Generator().manual_seed(seed_of("square-overflow", str(dtype)))
    big = 2.0e19 if dtype != torch.float16 else 60000.0
    # FP16 cannot hold a value whose square overflows: unscale 60000 by 2**49 (~3.4e19);
    # the ordinary values (|g| < 10) stay far below 1.8e19 after it.
    scale = 1.0 if dtype != torch.float16 else 2.0**-49
    g = random_grad(gen, 3 * CHUNK + 100, dtype, 1.0)
    for i in (5, CHUNK + 31, 3 * CHUNK + 7):  # two full rows and the short last row
        g[i] = big
    for grad_scale in (None, scale) if scale != 1.0 else (None, 0.5):
        rows = run_analyze([g], grad_scale)
        assert_bitwise(rows, emulate_analyze(g, grad_scale), f"rows with huge values ({dtype})")
        if grad_scale is None and dtype == torch.float16:
            continue  # 60000**2 fits FP32: nothing overflows without the scale
        assert math.isinf(rows[0, 0].item()) and math.isinf(rows[3, 0].item())
        assert math.isfinite(rows[2, 0].item())
        assert rows[:, 2].eq(0).all(), "a finite value was counted as non-finite"
        assert torch.isfinite(rows[:, 1]).all()


@pytest.mark.parametrize("numel", [97, 1025, 65537])
@pytest.mark.parametrize("grad_scale", [0.0, -0.0, math.nan], ids=["zero", "minus-zero", "nan"])
def test_unusable_scale_counts_only_real_elements(grad_scale, numel):
    """A scale of 0 or NaN makes every unscaled element non-finite; the count is the
    number of real elements, in full and short rows: the CPU kernel pads a short row
    after scaling (the padding never counts), as the CUDA kernel's lanes stop early."""
    gen = torch.Generator().manual_seed(numel)
    g = random_grad(gen, numel, torch.float32, 1.0)
    g[3] = 0.0  # 0 / 0 is NaN too
    rows = run_analyze([g], grad_scale)
    assert_bitwise(rows, emulate_analyze(g, grad_scale), "rows with an unusable scale")
    assert rows[:, 2].sum().item() == numel
    assert (rows[:, :2] == 0).all()


# --------------------------------------------------------------------------- merges


@pytest.mark.parametrize("n_rows", [1, 2, 255, 256, 257, 1023, 1024, 1025, 2048, 3000])
def test_merge_matches_canonical_emulation_bitwise(n_rows):
    gen = torch.Generator().manual_seed(n_rows)
    rows = torch.empty(n_rows, 3)
    rows[:, 0] = torch.rand(n_rows, generator=gen) * torch.pow(
        10.0, torch.empty(n_rows).uniform_(-6, 3, generator=gen)
    )
    rows[:, 1] = torch.rand(n_rows, generator=gen) * 100
    rows[:, 2] = torch.randint(0, 3, (n_rows,), generator=gen).float()
    out = run_merge(rows)
    assert out.shape == (math.ceil(n_rows / FAN_IN), 3)
    assert_bitwise(out, emulate_merge(rows.numpy()), f"merge_gradient_stats of {n_rows} rows")


@pytest.mark.parametrize("n_reports", [0, 1, 2, 7, 64])
def test_merge_chunks_is_a_left_fold(n_reports):
    gen = torch.Generator().manual_seed(100 + n_reports)
    reports = torch.rand(n_reports, 3, generator=gen) * torch.tensor([1e3, 10.0, 0.0])
    reports[:, 0] *= torch.pow(10.0, torch.empty(n_reports).uniform_(-8, 2, generator=gen))
    reports[:, 2] = torch.randint(0, 2, (n_reports,), generator=gen).float()
    out = torch.full((3,), float("nan"))
    ops.merge_gradient_stats_chunks(reports, out)
    assert_bitwise(out, emulate_chunks(reports.numpy()), f"fold of {n_reports} reports")


def test_merge_chunks_order_matters_for_the_bits_it_promises():
    # The fold is in the order given: reports whose sums round differently depending on
    # the order, so a kernel that reorders (or sums pairwise) gives other bits.
    reports = torch.tensor([[1.0, 0, 0], [2.0**-24, 0, 0], [2.0**-24, 0, 0]])
    out = torch.zeros(3)
    ops.merge_gradient_stats_chunks(reports, out)
    assert out[0].item() == 1.0  # (1 + 2^-24) rounds to 1, twice
    ops.merge_gradient_stats_chunks(reports.flip(0).contiguous(), out)
    assert out[0].item() == 1.0 + 2.0**-23


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=DTYPE_IDS)
def test_full_pipeline_bitwise_over_buckets(dtype):
    # Two buckets (different tensor mixes), each analyzed, reduced by its StatsPlan, then
    # folded: every stage bitwise equal to the emulation.
    gen = torch.Generator().manual_seed(17)
    buckets = [
        [random_grad(gen, n, dtype, 256.0) for n in (5000, 0, 12_345)],
        [random_grad(gen, n, dtype, 256.0) for n in (1, 4096, 7)],
    ]
    reports = torch.empty(len(buckets), 3)
    expected_reports = []
    for b, grads in enumerate(buckets):
        rows = run_analyze(grads, 256.0)
        plan = ruda_torch.StatsPlan(rows.shape[0])
        plan.reduce(rows, torch.empty(plan.scratch_elements), reports[b])
        emu_rows = np.concatenate([emulate_analyze(g, 256.0) for g in grads])
        expected_reports.append(emulate_merge(emu_rows)[0])
    assert_bitwise(reports, np.stack(expected_reports), "bucket reports")
    out = torch.empty(3)
    ops.merge_gradient_stats_chunks(reports, out)
    assert_bitwise(out, emulate_chunks(np.stack(expected_reports)), "merged report")


def test_plan_reduce_two_levels_bitwise():
    gen = torch.Generator().manual_seed(3)
    n = FAN_IN * FAN_IN + 5  # levels [1025, 2]
    rows = torch.rand(n, 3, generator=gen)
    rows[:, 2] = 0.0
    plan = ruda_torch.StatsPlan(n)
    assert plan.levels == [1025, 2]
    out = torch.empty(3)
    plan.reduce(rows, torch.empty(plan.scratch_elements), out)
    manual = run_merge(run_merge(run_merge(rows)))
    assert torch.equal(out, manual[0])
    # The emulation of the three levels, for the last two (the first is tested above).
    level1 = run_merge(rows).numpy()
    assert_bitwise(out, emulate_merge(emulate_merge(level1))[0], "two-level plan")


# ---------------------------------------------------------------------------- accuracy


def _global_norm(grads, grad_scale=None) -> float:
    rows = run_analyze(grads, grad_scale)
    plan = ruda_torch.StatsPlan(rows.shape[0])
    out = torch.empty(3)
    plan.reduce(rows, torch.empty(plan.scratch_elements), out)
    assert out[2].item() == 0
    return math.sqrt(out[0].item())


@pytest.mark.parametrize(
    "numel,rtol,n_levels",
    [(3_000_000, NORM_RTOL, 0), (8 * 1024 * 1024, NORM_RTOL_TWO_LEVELS, 1)],
    ids=["3M_one_merge", "8M_two_merges"],
)
def test_global_norm_accuracy(numel, rtol, n_levels):
    gen = torch.Generator().manual_seed(numel)
    # Heterogeneous sizes and magnitudes: the worst case for a plain FP32 running sum.
    g = torch.randn(numel, generator=gen) * torch.pow(
        10.0, torch.empty(numel).uniform_(-3, 1, generator=gen)
    )
    grads = [g[: numel // 3], g[numel // 3 :]]
    n_rows = sum(ops.stats_rows_for(t.numel()) for t in grads)
    assert len(ruda_torch.StatsPlan(n_rows).levels) == n_levels
    ours = _global_norm(grads)
    exact = math.sqrt(global_norm_reference(grads)[0])
    theirs = torch.linalg.vector_norm(g).item()
    our_err = abs(ours - exact) / exact
    torch_err = abs(theirs - exact) / exact
    assert our_err <= rtol, (
        f"global norm relative error {our_err:.3g} > {rtol:g} "
        f"(torch.linalg.vector_norm in FP32: {torch_err:.3g})"
    )


# ------------------------------------------------------------ determinism and no writes


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=DTYPE_IDS)
def test_thread_count_independent(dtype):
    gen = torch.Generator().manual_seed(23)
    grads = [random_grad(gen, n, dtype, 8.0) for n in (70 * CHUNK + 3, 5, 33 * CHUNK)]

    def pipeline():
        rows = run_analyze(grads, 8.0)
        merged = run_merge(torch.cat([rows] * 12))  # 1236 rows: two outputs
        out = torch.empty(3)
        ops.merge_gradient_stats_chunks(merged, out)
        return rows, merged, out

    one = with_threads(1, pipeline)
    two = with_threads(2, pipeline)
    for a, b, what in zip(one, two, ("rows", "merged", "report"), strict=True):
        assert same_bits(a, b), what


def test_zero_rows():
    rows = run_analyze([torch.empty(0), torch.empty(0, 3)])
    assert rows.shape == (0, 3)
    rows = run_analyze([])
    assert rows.shape == (0, 3)
    out = torch.empty(0, 3)
    ops.merge_gradient_stats(rows, out)
    report = torch.full((3,), float("nan"))
    ops.merge_gradient_stats_chunks(torch.empty(0, 3), report)
    assert torch.equal(report, torch.zeros(3))


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=DTYPE_IDS)
def test_gradients_and_inputs_never_written(dtype):
    gen = torch.Generator().manual_seed(29)
    grads = [random_grad(gen, n, dtype, 4.0) for n in (9000, 1)]
    grads[0][5] = float("nan")
    saved = [g.clone() for g in grads]
    scale = torch.tensor([4.0])
    rows = torch.empty(4, 3)
    ops.analyze_gradient(grads, rows, scale)
    for before, after in zip(saved, grads, strict=True):
        assert same_bits(before, after)
    assert torch.equal(scale, torch.tensor([4.0]))
    rows_before = rows.clone()
    out = torch.empty(1, 3)
    ops.merge_gradient_stats(rows, out)
    report = torch.empty(3)
    ops.merge_gradient_stats_chunks(out, report)
    assert same_bits(rows, rows_before)


# --------------------------------------------------------------------------- bad inputs


@dataclass
class StatsCall:
    """Arguments of one call; `run` calls the operator."""

    op: str
    grads: list[torch.Tensor]
    grad_scale: torch.Tensor | None
    out: torch.Tensor  # rows (analyze), out (merges)
    inp: torch.Tensor | None = None  # rows / reports of the merges

    def run(self):
        if self.op == "analyze":
            ops.analyze_gradient(self.grads, self.out, self.grad_scale)
        elif self.op == "merge":
            ops.merge_gradient_stats(self.inp, self.out)
        else:
            ops.merge_gradient_stats_chunks(self.inp, self.out)


OP_NAMES = {
    "analyze": "analyze_gradient",
    "merge": "merge_gradient_stats",
    "chunks": "merge_gradient_stats_chunks",
}


def _analyze_call() -> StatsCall:
    grads = [torch.randn(5000), torch.randn(10)]
    return StatsCall("analyze", grads, torch.tensor([2.0]), torch.full((3, 3), 7.0))


def _merge_call() -> StatsCall:
    return StatsCall("merge", [], None, torch.full((2, 3), 7.0), torch.rand(1500, 3))


def _chunks_call() -> StatsCall:
    return StatsCall("chunks", [], None, torch.full((3,), 7.0), torch.rand(4, 3))


def _set(**changes) -> Callable[[StatsCall], None]:
    def apply(call: StatsCall) -> None:
        for k, v in changes.items():
            setattr(call, k, v(call))

    return apply


BAD_INPUTS = [
    # (id, make the valid call, break it, expected message)
    (
        "analyze_rows_too_few",
        _analyze_call,
        _set(out=lambda c: torch.full((2, 3), 7.0)),
        r"analyze_gradient: rows must be a contiguous float32 tensor of shape \[3, 3\] "
        r"\(one row per 4096 gradient elements of each tensor; got Float \[2, 3\]\)",
    ),
    (
        "analyze_rows_width",
        _analyze_call,
        _set(out=lambda c: torch.full((3, 4), 7.0)),
        r"rows must be a contiguous float32 tensor of shape \[3, 3\]",
    ),
    (
        "analyze_rows_float64",
        _analyze_call,
        _set(out=lambda c: torch.full((3, 3), 7.0, dtype=torch.float64)),
        r"rows must be a contiguous float32 tensor .*got Double",
    ),
    (
        "analyze_rows_not_contiguous",
        _analyze_call,
        _set(out=lambda c: torch.full((3, 3), 7.0).t()),
        r"rows must be a contiguous float32 tensor",
    ),
    (
        "analyze_mixed_grad_dtypes",
        _analyze_call,
        _set(grads=lambda c: [c.grads[0], c.grads[1].half()]),
        r"analyze_gradient: grads\[1\] is Half but grads\[0\] is Float",
    ),
    (
        "analyze_grad_float64",
        _analyze_call,
        _set(grads=lambda c: [c.grads[0].double(), c.grads[1].double()]),
        r"grads\[0\] must be float32, float16 or bfloat16 \(got Double\)",
    ),
    (
        "analyze_grad_not_contiguous",
        _analyze_call,
        _set(grads=lambda c: [c.grads[0], torch.randn(20)[::2]]),
        r"grads\[1\] must be dense \(contiguous, or a permutation of a contiguous tensor",
    ),
    (
        "analyze_grad_scale_two_elements",
        _analyze_call,
        _set(grad_scale=lambda c: torch.tensor([2.0, 2.0])),
        r"grad_scale must be a contiguous tensor of 1 element\(s\)",
    ),
    (
        "analyze_grad_scale_float64",
        _analyze_call,
        _set(grad_scale=lambda c: torch.tensor([2.0], dtype=torch.float64)),
        r"grad_scale must be float32 \(got Double\)",
    ),
    (
        "analyze_rows_alias_grad",
        _analyze_call,
        _set(out=lambda c: c.grads[0][:9].view(3, 3)),
        r"analyze_gradient: grads\[0\] overlaps rows in memory",
    ),
    (
        "merge_rows_width",
        _merge_call,
        _set(inp=lambda c: torch.rand(1500, 4)),
        r"merge_gradient_stats: rows must be a contiguous float32 tensor of shape \[n, 3\]",
    ),
    (
        "merge_rows_float64",
        _merge_call,
        _set(inp=lambda c: torch.rand(1500, 3, dtype=torch.float64)),
        r"rows must be a contiguous float32 tensor .*got Double",
    ),
    (
        "merge_out_rows",
        _merge_call,
        _set(out=lambda c: torch.full((1, 3), 7.0)),
        r"out must be a contiguous float32 tensor of shape \[2, 3\] for 1500 input rows",
    ),
    (
        "merge_out_aliases_rows",
        _merge_call,
        _set(out=lambda c: c.inp[:2]),
        r"merge_gradient_stats: rows overlaps out in memory",
    ),
    (
        "chunks_reports_width",
        _chunks_call,
        _set(inp=lambda c: torch.rand(4, 2)),
        r"merge_gradient_stats_chunks: reports must be a contiguous float32 tensor of shape "
        r"\[k, 3\]",
    ),
    (
        "chunks_out_four_elements",
        _chunks_call,
        _set(out=lambda c: torch.full((4,), 7.0)),
        r"out must be a contiguous float32 tensor of 3 elements",
    ),
    (
        "chunks_out_aliases_reports",
        _chunks_call,
        _set(out=lambda c: c.inp[1]),
        r"reports overlaps out in memory",
    ),
]


@pytest.mark.parametrize(
    "make,breaker,message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS]
)
def test_bad_inputs_rejected_and_nothing_changed(make, breaker, message):
    call = make()
    breaker(call)
    tensors = [*call.grads, call.out] + [t for t in (call.grad_scale, call.inp) if t is not None]
    saved = [t.clone() for t in tensors]
    with pytest.raises(RuntimeError, match=message) as info:
        call.run()
    assert str(info.value).startswith(f"ruda_torch.{OP_NAMES[call.op]}: "), str(info.value)
    for before, after in zip(saved, tensors, strict=True):
        assert same_bits(before, after)


def test_meta_tensor_among_cpu_arguments_is_an_error():
    # docs/design.md section 2: no silent fallback to another backend. A meta grad_scale among CPU
    # arguments must not send the call to the fake (meta) kernel, which writes nothing.
    rows = torch.full((1, 3), 7.0)
    with pytest.raises(RuntimeError, match=r"grad_scale.*(cpu|meta)"):
        ops.analyze_gradient([torch.ones(10)], rows, torch.ones(1, device="meta"))
    assert same_bits(rows, torch.full((1, 3), 7.0))


# ------------------------------------------------------------------------------ opcheck

OPCHECK_CASES = [
    (
        "analyze_fp32_scaled",
        torch.ops.ruda_torch.analyze_gradient.default,
        lambda: ([torch.randn(5000), torch.randn(0), torch.randn(10)], torch.tensor([2.0]),
                 torch.empty(3, 3)),
    ),
    (
        "analyze_bf16",
        torch.ops.ruda_torch.analyze_gradient.default,
        lambda: ([torch.randn(4097).bfloat16()], None, torch.empty(2, 3)),
    ),
    (
        "merge",
        torch.ops.ruda_torch.merge_gradient_stats.default,
        lambda: (torch.rand(1500, 3), torch.empty(2, 3)),
    ),
    (
        "chunks",
        torch.ops.ruda_torch.merge_gradient_stats_chunks.default,
        lambda: (torch.rand(4, 3), torch.empty(3)),
    ),
]  # fmt: skip


@pytest.mark.parametrize(
    "op,make_args", [c[1:] for c in OPCHECK_CASES], ids=[c[0] for c in OPCHECK_CASES]
)
def test_opcheck(op, make_args):
    torch.library.opcheck(op, make_args())
