#!/usr/bin/env bash
# The one script to run on a GPU machine: build the CUDA kernels in place, run the GPU
# tests, benchmark on the device, print a summary. A few minutes in all.
#
#   bash tools/gpu_check.sh            (from anywhere; it works in the repository root)
#
# Expects a Python with a CUDA build of torch, ninja, pytest and nvcc (no network needed,
# nothing is downloaded). Stops at once, with exit status 2, when no GPU is visible.
#
# Steps:
#   1. environment: nvidia-smi (GPU, driver, clocks, power, load), nvcc, torch
#   2. build: RUDA_TORCH_CUDA=1 `python setup.py build_ext --inplace` (BUILD_MODE=inplace,
#      the default: objects stay in build/ so a rerun on the same machine recompiles only
#      what changed, and nothing is installed; the extension lands in ruda_torch/ and
#      PYTHONPATH points at the repository) or `pip install --no-build-isolation
#      --no-deps --no-index -e .` (BUILD_MODE=pip); timed
#   1b. preflight: numpy, pytest, setuptools, ninja and a real toolkit root, in seconds
#   3. tests (before any benchmark): tools/run_adamw_regressions.py --suite cuda, i.e. `pytest tests -m gpu -q
#      -ra`, with its JSON record (it fails when no gpu test passes)
#   4. benchmarks (benchmarks/bench_adamw.py --device cuda, but b.):
#      a. FP32 gradients, BENCH_ELEMENTS (default 2^29 = 536,870,912) in 200 tensors,
#         every variant, the pipeline comparison, bandwidth against the device-to-device
#         copy and a.add_(b), host syncs per step (set_sync_debug_mode), and the
#         20,000 x 512 many-small case
#      b. the moments in FP32, BF16, 8 and 4 bits against torch's fused step and
#         a.add_(b), BENCH_SMALL_ELEMENTS (2^28; benchmarks/bench_state_precision.py)
#      c. the pipelines with torch.amp.GradScaler, BENCH_SMALL_ELEMENTS
#      d. BF16 gradients, ours vs the staged baseline, BENCH_SMALL_ELEMENTS
#   5. a summary table of everything above (each benchmark's table is also printed as
#      soon as it finishes; one skipped for lack of time is a warning, not a failure)
#
# Output: with $OUT set, logs and JSON go there (9 files at most: gpu_check.log,
# build.log, the regression record and its pytest log, bench.log and four bench JSON
# files); without it, to out/gpu_check/. Exit status: 0 when the build, the tests and the
# benchmarks (no divergence) all passed; 1 otherwise; 2 when no GPU is visible.
#
# Variables: PYTHON (default python3), BUILD_MODE (inplace|pip), MAX_JOBS (default: all
# cores), BENCH_ELEMENTS, BENCH_SMALL_ELEMENTS; BUILD_TIMEOUT (300), TEST_TIMEOUT (180),
# BENCH_TIMEOUT (150 per benchmark) and DEADLINE (540, the whole script), in seconds.
# Give the machine's command limit a minute more than DEADLINE.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$(pwd)"

PYTHON="${PYTHON:-$(command -v python3 || command -v python || echo python3)}"
BUILD_MODE="${BUILD_MODE:-inplace}"
BENCH_ELEMENTS="${BENCH_ELEMENTS:-536870912}"
BENCH_SMALL_ELEMENTS="${BENCH_SMALL_ELEMENTS:-268435456}"
BUILD_TIMEOUT="${BUILD_TIMEOUT:-300}"
TEST_TIMEOUT="${TEST_TIMEOUT:-180}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-150}"
# The whole script stops within DEADLINE seconds: every step gets at most what is left
# (a step that would get under 45 s is skipped and reported), so that the logs and JSON
# written so far come back even from a machine lent for a few minutes.
DEADLINE="${DEADLINE:-540}"
export MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 8)}"

RESULTS="${OUT:-out/gpu_check}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
# Every exit goes through finish: it closes our side of the pipe and waits for tee, so the
# last lines always reach gpu_check.log before the machine is handed back.
finish() {
  exec 1>&- 2>&-
  wait "$TEE_PID" 2>/dev/null
  exit "$1"
}

T_START=$SECONDS
section() { printf '\n==== %s (t=%ds)\n' "$*" "$((SECONDS - T_START))"; }
budget() {  # budget WANTED: seconds a step may take, at most what is left before DEADLINE
  local left=$((DEADLINE - (SECONDS - T_START)))
  if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}
BUILD_STATUS="not run"
TEST_STATUS="not run"
BENCH_STATUS=()
WARNINGS=()
FAILED=0

# ------------------------------------------------------------------------ 1. environment
section "environment"
echo "repository: $REPO"
echo "python: $PYTHON ($("$PYTHON" --version 2>&1))"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || true
  nvidia-smi --query-gpu=name,driver_version,pstate,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,power.limit,temperature.gpu,utilization.gpu,memory.used,memory.total \
    --format=csv || true
else
  echo "nvidia-smi: not found"
fi
if command -v nvcc >/dev/null 2>&1; then nvcc --version | tail -n 2; else echo "nvcc: not on PATH"; fi
echo "cores: $(nproc 2>/dev/null || echo '?'), MAX_JOBS=$MAX_JOBS"

if ! "$PYTHON" - <<'EOF'
import sys
try:
    import torch
except Exception as e:  # noqa: BLE001
    print(f"gpu_check: torch is not importable: {e}")
    sys.exit(1)
print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, "
      f"GPU visible: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit(1)
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
EOF
then
  echo
  echo "gpu_check: STOP: no GPU is visible to torch (torch.cuda.is_available() is False, or"
  echo "torch cannot be imported). This script only makes sense on a machine with a CUDA GPU."
  finish 2
fi

# What the build, the tests and the benchmarks need, checked in seconds before any of
# them starts: a run that would fail half-way for a missing package wastes the machine.
section "preflight"
if ! "$PYTHON" - "$REPO" <<'EOF'
import importlib.util
import shutil
import subprocess
import sys

import torch

missing = []
for module in ("numpy", "pytest", "setuptools"):
    if importlib.util.find_spec(module) is None:
        missing.append(f"the Python module {module} (pip install {module})")
if shutil.which("ninja") is None and importlib.util.find_spec("ninja") is None:
    missing.append("ninja (pip install ninja, or the ninja binary on PATH)")
spec = importlib.util.spec_from_file_location("ruda_torch_setup", f"{sys.argv[1]}/setup.py")
setup = importlib.util.module_from_spec(spec)
spec.loader.exec_module(setup)  # main() runs only as a script
home = setup.find_cuda_home(torch.version.cuda)
if home is None:
    missing.append("a CUDA toolkit root (a folder with a real bin/nvcc and lib64/libcudart*): "
                   "set CUDA_HOME")
else:
    out = subprocess.run([f"{home}/bin/nvcc", "--version"], capture_output=True, text=True)
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "?"
    print(f"toolkit: {home} ({last})")
if missing:
    print("gpu_check: STOP: missing " + "; ".join(missing))
    sys.exit(1)
print("preflight: numpy, pytest, setuptools, ninja and the toolkit are there")
EOF
then
  finish 1
fi

# ------------------------------------------------------------------------------ 2. build
section "build ($BUILD_MODE, RUDA_TORCH_CUDA=1)"
export RUDA_TORCH_CUDA=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
T0=$SECONDS
if [ "$BUILD_MODE" = "pip" ]; then
  BUILD_CMD=("$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -v -e .)
else
  BUILD_CMD=("$PYTHON" setup.py build_ext --inplace)
fi
T_BUILD=$(budget "$BUILD_TIMEOUT")
echo "\$ ${BUILD_CMD[*]}  (log: build.log, timeout ${T_BUILD}s)"
timeout "$T_BUILD" "${BUILD_CMD[@]}" >"$RESULTS/build.log" 2>&1
rc=$?
BUILD_S=$((SECONDS - T0))
grep -E '^\[ruda_torch build\]' "$RESULTS/build.log" || true
if [ $rc -ne 0 ]; then
  BUILD_STATUS="failed (exit $rc after ${BUILD_S}s)"
  echo "build: $BUILD_STATUS; last lines of build.log:"
  tail -n 40 "$RESULTS/build.log"
  FAILED=1
else
  BUILD_STATUS="passed (${BUILD_S}s)"
  echo "build: $BUILD_STATUS"
fi
BACKENDS="$("$PYTHON" -c 'import ruda_torch; print(",".join(ruda_torch.compiled_backends()))' 2>&1 | tail -n 1)"
echo "ruda_torch.compiled_backends(): $BACKENDS"
case ",$BACKENDS," in
  *,cuda,*) ;;
  *)
    echo "gpu_check: the extension has no CUDA kernels; the tests and benchmarks below will fail"
    FAILED=1
    ;;
esac

# ------------------------------------------------------------------------------ 3. tests
section "GPU tests (pytest -m gpu via tools/run_adamw_regressions.py --suite cuda)"
T0=$SECONDS
T_TEST=$(budget "$TEST_TIMEOUT")
if [ "$T_TEST" -lt 45 ]; then
  echo "tests: skipped, ${T_TEST}s left before DEADLINE=${DEADLINE}s"
  rc=124
else
  "$PYTHON" tools/run_adamw_regressions.py --suite cuda --timeout "$T_TEST" \
    --out "$RESULTS/regressions" --python "$PYTHON"
  rc=$?
fi
TEST_S=$((SECONDS - T0))
for f in "$RESULTS"/regressions/*/*.log; do
  [ -f "$f" ] && tail -n 30 "$f"
done
if [ $rc -eq 0 ]; then TEST_STATUS="passed (${TEST_S}s)"; else
  TEST_STATUS="failed (runner exit $rc after ${TEST_S}s)"
  FAILED=1
fi
echo "tests: $TEST_STATUS"

summarize() {  # summarize NAME...: the table of each benchmark's JSON
  "$PYTHON" - "$RESULTS" "$@" <<'EOF'
import json, sys
from pathlib import Path

results = Path(sys.argv[1])
for name in sys.argv[2:]:
    path = results / f"bench_{name}.json"
    if not path.is_file():
        print(f"bench {name}: no JSON (see bench.log)")
        continue
    rec = json.loads(path.read_text())
    env = rec.get("environment", {})
    print(f"\nbench {name}: {env.get('gpu_name')} | torch {env.get('torch')} | exit "
          f"{rec.get('exit_status')}")
    for case in rec.get("cases", []):
        print(f"  {case['case']}: {case['elements']:,} elements, {case['tensors']:,} tensors, "
              f"grads {case['grad_dtype']}{', GradScaler' if case['scaler'] else ''}"
              + (f"  DIVERGENCE: {case['divergence']}" if case.get("divergence") else ""))
        print(f"    {'variant':<15} {'median ms':>10} {'min':>9} {'max':>9} {'B/el':>5} "
              f"{'GB/s':>8} {'%copy':>6} {'%add_':>6} {'syncs':>5}")
        for v, r in case["results"].items():
            fc, fa = r.get("fraction_of_d2d_copy"), r.get("fraction_of_stream_add")
            print(f"    {v:<15} {r['median_ms']:>10.3f} {r['min_ms']:>9.3f} {r['max_ms']:>9.3f} "
                  f"{r['model_bytes_per_element']:>5} {r['gbps']:>8.1f} "
                  f"{100 * fc if fc else float('nan'):>5.0f}% "
                  f"{100 * fa if fa else float('nan'):>5.0f}% "
                  f"{str(r.get('host_syncs_per_step', '')):>5}")
        for k, val in case.get("ratios", {}).items():
            print(f"    {k:<28} {val:.3f}")
    if isinstance(rec.get("results"), dict):  # bench_state_precision.py's record
        for v, r in rec["results"].items():
            sb = r.get("state_bytes_per_element")
            print(f"    {v:<18} {r['median_ms']:>10.3f} ms {r['speedup_vs_torch_fused']:>6.2f}x "
                  f"torch's fused step {r['model_gbs']:>8.1f} GB/s"
                  + (f", state {sb:.3f} B/el" if sb else ""))
    for k, val in rec.get("summary", {}).items():
        if k not in ("at_elements", "goals_judged", "fastest_batches"):
            print(f"  summary {k:<26} {val:.3f}")
EOF
}

# ------------------------------------------------------------------------- 4. benchmarks
BENCH_LOG="$RESULTS/bench.log"
: >"$BENCH_LOG"
bench() {  # bench NAME ARGS...: one benchmark run, its JSON at bench_NAME.json
  local name="$1"
  shift
  section "benchmark $name: $*"
  local t0=$SECONDS
  local limit
  limit=$(budget "$BENCH_TIMEOUT")
  if [ "$limit" -lt 45 ]; then
    # Out of time, not broken: a warning, so that the tests' verdict stands.
    BENCH_STATUS+=("$name: skipped (${limit}s left before DEADLINE=${DEADLINE}s)")
    WARNINGS+=("benchmark $name skipped for lack of time")
    echo "skipped: ${limit}s left"
    return
  fi
  # "states": the low-precision moments (benchmarks/bench_state_precision.py), whose JSON
  # the summary does not tabulate: its table is in bench.log.
  local script=benchmarks/bench_adamw.py
  [ "$name" = states ] && script=benchmarks/bench_state_precision.py
  timeout "$limit" "$PYTHON" "$script" --device cuda \
    --json "$RESULTS/bench_$name.json" "$@" 2>&1 | tee -a "$BENCH_LOG"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    BENCH_STATUS+=("$name: passed ($((SECONDS - t0))s)")
  else
    BENCH_STATUS+=("$name: FAILED (exit $rc after $((SECONDS - t0))s; 124 = timeout)")
    FAILED=1
  fi
  summarize "$name"  # its table now, in case the machine goes before the end
}
bench fp32 --elements "$BENCH_ELEMENTS" --tensors 200 --iterations 10 --samples 7 --warmup 3 \
  --many-small
bench states --elements "$BENCH_SMALL_ELEMENTS" --tensors 200 --iterations 10 --samples 5 \
  --warmup 3 --variants ours_fp32,ours_bf16,ours_8bit,ours_4bit,torchao_4bit,stream_add
bench scaler --elements "$BENCH_SMALL_ELEMENTS" --tensors 200 --iterations 10 --samples 5 \
  --warmup 3 --scaler --no-many-small --variants ours_fused,torch_fused,torch_pipeline,ours_pipeline
bench bf16 --elements "$BENCH_SMALL_ELEMENTS" --tensors 200 --iterations 10 --samples 5 \
  --warmup 3 --grad-dtype bfloat16 --no-many-small

# ---------------------------------------------------------------------------- 5. summary
section "summary"
summarize fp32 states scaler bf16
echo
echo "build:  $BUILD_STATUS"
echo "tests:  $TEST_STATUS"
for s in "${BENCH_STATUS[@]}"; do echo "bench:  $s"; done
for w in "${WARNINGS[@]}"; do echo "warning: $w"; done
echo "total:  $((SECONDS - T_START))s; results in $RESULTS"
ls -1 "$RESULTS" "$RESULTS"/regressions 2>/dev/null | sed 's/^/  /'
if [ "$FAILED" -ne 0 ]; then
  echo "gpu_check: FAILED"
  finish 1
fi
echo "gpu_check: passed"
finish 0
