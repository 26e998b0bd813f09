"""Shows that the CUDA emulation catches what it is there to catch (Note [CUDA emulation] in
csrc/cuda_sim/cuda_sim.h): each mutation below is applied to a copy of csrc/cuda, the
emulated kernels are built from the copy, and the tests that cover the mutated code must
fail. Run by `make test-cuda-sim`; exits nonzero when a mutation survives.

Mutations: every __syncthreads() of the statistics kernels removed in turn (the serial
schedules make the phases run thread by thread, first to last and last to first, so a
thread reads a value not yet written or already replaced; the barrier that only orders
thread 0's next write after the other threads' reads of a value they do not use is
caught by ThreadSanitizer in the concurrent schedule); the tail loops of the update and of
the statistics stopping one element early (different bits) or going one past the end
(AddressSanitizer: the test buffers end where the tensors do); a shuffle offset off by
one.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each mutant in a source folder of its own (build/cuda_sim/mutant-<i>), so that several
# build and run at once (--jobs); their builds link the plain build's binding objects and
# compile the kernels alone (tests/cuda_sim/build.py).
MUTANTS = ROOT / "build" / "cuda_sim"


def _syncthreads(n: int):
    def apply(text: str) -> str:
        parts = text.split("__syncthreads();")
        assert len(parts) > n + 1, f"fewer than {n + 1} __syncthreads() in grad_stats_cuda.cu"
        return (
            "__syncthreads();".join(parts[: n + 1])
            + "/* removed */"
            + "__syncthreads();".join(parts[n + 1 :])
        )

    return apply


def _replace(old: str, new: str):
    def apply(text: str) -> str:
        assert text.count(old) == 1, f"the mutation's anchor is stale: {old!r}"
        return text.replace(old, new)

    return apply


def _replace_each(*pairs: tuple[str, str]):
    def apply(text: str) -> str:
        for old, new in pairs:
            text = _replace(old, new)(text)
        return text

    return apply


# (name, file, mutation, pytest -k expression, the sanitizer that must catch it or None)
MUTATIONS = [
    ("syncthreads #1 (after the lanes' stores)", "grad_stats_cuda.cu", _syncthreads(0),
     "merge_matches_cpu and not concurrent", None),
    ("syncthreads #2 (between tree levels)", "grad_stats_cuda.cu", _syncthreads(1),
     "merge_matches_cpu and not concurrent", None),
    ("syncthreads #3 (before the next row reuses the arrays)", "grad_stats_cuda.cu",
     _syncthreads(2), "merge_matches_cpu and concurrent", "thread"),
    ("update tail loop one element short", "adamw_cuda.cu",
     _replace("for (int32_t kk = k; kk < end; ++kk)", "for (int32_t kk = k; kk < end - 1; ++kk)"),
     "update_matches_cpu and forward and float32-float32-aligned", None),
    ("update tail loop one element past the end", "adamw_cuda.cu",
     _replace("for (int32_t kk = k; kk < end; ++kk)", "for (int32_t kk = k; kk <= end; ++kk)"),
     "update_matches_cpu and forward and float32-float32-aligned", "address"),
    ("scalar update loop one element short", "adamw_cuda.cu",
     _replace("k < vt.count; k += kThreads)", "k < vt.count - 1; k += kThreads)"),
     "update_matches_cpu and forward and unaligned", None),
    ("tile walk skipping the tensor change", "adamw_cuda.cu",
     _replace("    while (u >= next) {  // the tensors before unit u (empty ones own no unit)",
              "    while (false) {  // the tensors before unit u (empty ones own no unit)"),
     "update_matches_cpu and forward and float32-float32-aligned", None),
    ("statistics row loop one element short", "grad_stats_cuda.cu",
     _replace("for (int64_t k = lane; k < count; k += kRowLanes)",
              "for (int64_t k = lane; k < count - 1; k += kRowLanes)"),
     "analyze_matches_cpu and forward", None),
    ("warp shuffle offset off by one", "grad_stats_cuda.cu",
     _replace("__shfl_down_sync(kAll, v.sum_sq, s)", "__shfl_down_sync(kAll, v.sum_sq, s + 1)"),
     "analyze_matches_cpu and forward", None),
    ("8-bit block scale from the lane's own values (no warp reduction)", "cuda_utils.cuh",
     _replace("return __reduce_max_sync(0xffffffffu, bits);", "return bits;"),
     "update_8bit_matches_cpu and forward and fp32-amsgrad", None),
    ("8-bit step reads the scale of the tile's first block", "adamw_cuda.cu",
     _replace("int64_t scale = static_cast<int64_t>(static_cast<uint64_t>(state) / kBlock8);",
              "int64_t scale = static_cast<int64_t>(static_cast<uint64_t>(state - kb) / kBlock8);"),
     "update_8bit_matches_cpu and forward and fp32-amsgrad and aligned", None),
    ("8-bit 16-bit values: a pair set into the quarter's other word", "cuda_utils.cuh",
     _replace("    w[h & 1] = bits;", "    w[(h + 1) & 1] = bits;"),
     "update_8bit_matches_cpu and forward and bf16-master and aligned", None),
    ("8-bit signed codes decoded without their sign", "cuda_utils.cuh",
     _replace("          0x9FC09FFFu;", "          0x1FC01FFFu;"),
     "dequantize_every_code_matches_cpu", None),
    ("8-bit signed codes coded without their sign", "cuda_utils.cuh",
     _replace("return w | (signs & (w + 0x7F7F7F7Fu) & 0x80808080u);", "return w;"),
     "quantize_8bit_every_class_of_value_matches_cpu", None),
    ("8-bit stochastic rounding of a pair without the canonical NaN's clamp", "cuda_utils.cuh",
     _replace("const int32_t a = min(static_cast<int32_t>(float_bits(lo)), 0x7FFF0000);",
              "const int32_t a = static_cast<int32_t>(float_bits(lo));"),
     "update_8bit_overflow_matches_cpu and forward and stochastic and aligned", None),
    ("8-bit unsigned codes: a value that is not zero coded 0", "cuda_utils.cuh",
     _replace("h = __vmaxu2(h, __vminu2(h, 0x00010001u) << 6);", "h = __vmaxu2(h, 0u);"),
     "quantize_8bit_every_class_of_value_matches_cpu", None),
    ("8-bit edge blocks: the last code not written back", "adamw_cuda.cu",
     _replace("if (k + j < n) codes8(L, q, sk_out)[k + j] = code_of(oc[q], j);",
              "if (k + j < n - 1) codes8(L, q, sk_out)[k + j] = code_of(oc[q], j);"),
     "update_8bit_matches_cpu and forward and fp32 and unaligned", None),
    ("8-bit blocks with an infinity decoded as ordinary ones", "cuda_utils.cuh",
     _replace("  if (special_block(s)) {\n    for (int j = 0; j < kPerLane8; ++j) x[j] =",
              "  if (false) {\n    for (int j = 0; j < kPerLane8; ++j) x[j] ="),
     "update_8bit_overflow_matches_cpu and forward and fp32-amsgrad and aligned", None),
    ("4-bit direct kernel: no block stepped directly", "adamw_cuda.cu",
     _replace("kb < whole; kb += kWarps8 * kBlock) {\n        step_block4<",
              "kb < 0; kb += kWarps8 * kBlock) {\n        step_block4<"),
     "update_4bit_matches_cpu and forward and fp32 and aligned and not amsgrad", None),
    ("4-bit direct kernel: the rows' whole blocks left to no kernel", "adamw_cuda.cu",
     _replace("if (direct != (kPass == Pass8::kRows)) continue;",
              "if (direct || kPass != Pass8::kEdges) continue;"),
     "update_4bit_matches_cpu and forward and fp32 and aligned and not amsgrad", None),
    ("4-bit rows: their whole blocks left to the edge kernel", "adamw_cuda.cu",
     _replace("vt.row != 0 && block4_direct<P, G, AMSGRAD, REM>(L, tile, b, has_master);",
              "false;"),
     "rows_whole_blocks_take_the_direct_kernel and 4bit and fp32", None),
    ("8-bit rows: their whole blocks left to the edge kernel", "adamw_cuda.cu",
     _replace_each(
         ("if (vt.row != 0 && row_block8_direct<P, G, AMSGRAD, REM>(L, b, has_master)) continue;",
          "if (false) continue;"),
         ("if (!row_block8_direct<P, G, AMSGRAD, REM>(L, b, has_master)) continue;",
          "if (true) continue;")),
     "rows_whole_blocks_take_the_direct_kernel and 8bit and fp32", None),
    ("8-bit rows: a row's shorter last block stepped as a whole one", "adamw_cuda.cu",
     _replace("  return b.n == static_cast<int32_t>(kBlock8) &&\n", "  return b.n > 0 &&\n"),
     "update_8bit_in_rows_matches_cpu and forward and fp32 and aligned", None),
    ("4-bit blocks of rows: the scale of the row's first block", "adamw_cuda.cu",
     _replace("return {blk.first, off + blk.first, blk.nibble, scale_index4(e, kc),",
              "return {blk.first, off + blk.first, blk.nibble, scale_index4(e, kc - kc % "
              "row_stride4(e.row)),"),
     "update_4bit_matches_cpu and forward and fp32 and aligned and not amsgrad", None),
    ("4-bit edge blocks: an odd block's pad nibble read as a code", "adamw_cuda.cu",
     _replace("          cw[q] |= (k + j + 1 < n ? byte : byte & 15u) << (4 * j);",
              "          cw[q] |= byte << (4 * j);"),
     "update_4bit_matches_cpu and forward and fp32 and aligned and not amsgrad", None),
    ("4-bit lanes: the code book's kinds swapped", "quant4_lanes.cuh",
     _replace("constexpr int kBook4 = kCode == Code4::kSigned ? 0 : 1;",
              "constexpr int kBook4 = kCode == Code4::kSigned ? 1 : 0;"),
     "dequantize_every_4bit_code_matches_cpu", None),
    ("4-bit lanes: a block with non-finite values coded as an ordinary one", "quant4_lanes.cuh",
     _replace("  if (special_block(s)) {  // the warp's branch: a block with non-finite values\n"
              "    uint32_t c = 0u;",
              "  if (false) {\n    uint32_t c = 0u;"),
     "quantize_4bit_matches_cpu and forward", None),
    ("4-bit encoder: no rounding to odd before the rounding to nearest", "quant4_lanes.cuh",
     _replace("  h |= (__float_as_uint(back.x) != __float_as_uint(a0) ? 1u : 0u) |",
              "  h |= 0u * (__float_as_uint(back.x) != __float_as_uint(a0) ? 1u : 0u) |"),
     "quantize_4bit_every_class_of_value_matches_cpu", None),
    ("4-bit encoder: a positive second moment coded 0", "quant4_lanes.cuh",
     _replace("r = __vmaxu2(r, nonzero);", "r = __vmaxu2(r, 0u * nonzero);"),
     "quantize_4bit_every_class_of_value_matches_cpu", None),
    ("4-bit stochastic rounding: a pair rounded with its first element's bits", "adamw_cuda.cu",
     _replace("rounding_bits(key(), at + 1));", "rounding_bits(key(), at));"),
     "update_4bit_matches_cpu and forward and stochastic and aligned", None),
]  # fmt: skip


def sanitizer_env(sanitizer: str) -> dict:
    """What a run under `sanitizer` needs: the module built with it, its runtime
    preloaded (Python is not built with it), and for ASan triton hidden
    (tests/cuda_sim/no_triton)."""
    lib = subprocess.run(["c++", f"-print-file-name=lib{'tsan' if sanitizer == 'thread' else 'asan'}.so"],
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    env = {"LD_PRELOAD": lib, "RUDA_CUDA_SIM_SANITIZE": sanitizer}
    if sanitizer == "thread":
        env["TSAN_OPTIONS"] = "halt_on_error=1 exitcode=66 report_signal_unsafe=0"
    else:
        env["ASAN_OPTIONS"] = "detect_leaks=0"
        env["PYTHONPATH"] = str(ROOT / "tests" / "cuda_sim" / "no_triton")
    return env


def build(env: dict) -> None:
    """Builds the emulated kernels as `env` selects, outside of any preloaded sanitizer
    (a ThreadSanitizer module then fails to load here, without its runtime preloaded: the
    test run that follows loads it; a build error shows there too)."""
    code = "import sys; sys.path.insert(0, 'tests/cuda_sim'); from build import load; load()"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True)


# The longest a mutant's tests may run (the unmutated selections take under a minute).
MUTANT_TIMEOUT_S = 600


def run(index, name, file, mutate, select, sanitizer) -> tuple[bool, str]:
    """(whether the mutant is caught (its tests fail), the line that says so)."""
    sys.path.insert(0, str(ROOT / "tests" / "cuda_sim"))
    from build import sync_sources

    folder = MUTANTS / f"mutant-{index}"
    sync_sources(folder)
    target = folder / "cuda" / file
    target.write_text(mutate(target.read_text()))
    env = dict(os.environ, RUDA_CUDA_SIM_SOURCE=str(folder))
    start = time.monotonic()
    if sanitizer:
        env.update(sanitizer_env(sanitizer))
        build(dict(env, LD_PRELOAD=""))  # the compiler must not run under the sanitizer
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/test_cuda_sim.py", "-q", "-x", "-p",
             "no:cacheprovider", "-k", select],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=MUTANT_TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        # A mutant can leave the emulated threads waiting on each other forever (one
        # mutant's selection once waited 21 minutes with every thread idle). A hang is
        # a mutant its tests caught, as a real GPU would time out, and it must not stall
        # the run: the unmutated selections take under a minute.
        took = time.monotonic() - start
        return (
            True,
            f"caught  {name} ({took:.0f} s): its tests hung (killed after {MUTANT_TIMEOUT_S} s)",
        )
    took = time.monotonic() - start
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next((line for line in reversed(tail) if "passed" in line or "failed" in line
                    or "ThreadSanitizer" in line), tail[-1] if tail else "")  # fmt: skip
    caught = proc.returncode not in (0, 5)
    if (
        "error: " in proc.stdout + proc.stderr
        and "Error building extension" in proc.stdout + proc.stderr
    ):
        caught = False  # a mutant that does not build proves nothing
        summary = "the mutant did not build"
    return caught, f"{'caught ' if caught else 'SURVIVED'} {name} ({took:.0f} s): {summary}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sanitizers", action=argparse.BooleanOptionalAction, default=True,
                        help="also run the mutations only a sanitizer can catch")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="mutants built and run at once (default: one per CPU)")  # fmt: skip
    args = parser.parse_args()
    caught, survived = _run_all(args)
    print(f"cuda-sim mutations: {len(caught)} caught, {len(survived)} survived")
    return 1 if survived else 0


def _run_all(args) -> tuple[list, list]:
    from concurrent.futures import ThreadPoolExecutor

    chosen = []
    for i, (name, file, mutate, select, sanitizer) in enumerate(MUTATIONS):
        if sanitizer and not args.sanitizers:
            print(f"skipped  {name} (--no-sanitizers)")
        else:
            chosen.append((i, name, file, mutate, select, sanitizer))
    caught, survived = [], []
    # The threads only wait for subprocesses; each mutant has folders of its own.
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = pool.map(lambda job: run(*job), chosen)
        for job, (was_caught, line) in zip(chosen, results, strict=True):
            print(line, flush=True)
            (caught if was_caught else survived).append(job[1])
    return caught, survived


if __name__ == "__main__":
    sys.exit(main())
