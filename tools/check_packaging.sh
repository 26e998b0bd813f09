#!/usr/bin/env bash
# `make test-packaging`: the distribution formats, tried as users install them.
#
#   1. the sdist (built by `make sdist`, isolated, as maintainers run `python -m build`)
#      holds every file a build needs: all of csrc/ (the CUDA sources too), setup.py,
#      pyproject.toml, README.md and the package;
#   2. `pip install <sdist>` with build isolation (pip's default) stops at once with the
#      message that says to use --no-build-isolation, instead of compiling against a
#      throwaway torch (Note [Built against one torch] in ruda_torch/_build.py);
#   3. the wheel built from the sdist against the CPU torch of `make test-cpu-torch` (`pip
#      wheel --no-build-isolation`, in WHEEL_DIR: the Makefile builds it once for both
#      targets) installs into a fresh scratch venv that sees that torch, and imports,
#      reports its backends and ISA, and steps like torch.optim.AdamW;
#   4. the same wheel under another torch release (PYTHON's) refuses to import, naming
#      both versions.
# Usage: tools/check_packaging.sh PYTHON CPU_VENV WHEEL_DIR. Prints "N passed, N failed" last.
set -uo pipefail

PY=${1:?usage: tools/check_packaging.sh PYTHON CPU_VENV WHEEL_DIR}
CPU_VENV=${2:?usage: tools/check_packaging.sh PYTHON CPU_VENV WHEEL_DIR}
WHEEL_DIR=${3:?usage: tools/check_packaging.sh PYTHON CPU_VENV WHEEL_DIR}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
SDIST=$(ls build/sdist/ruda_torch-*.tar.gz 2>/dev/null | head -n 1)
[ -n "$SDIST" ] || { echo "no sdist in build/sdist: run make sdist" >&2; exit 2; }
SDIST=$ROOT/$SDIST
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
passed=0
failed=0

result() {  # name, status
  if [ "$2" -eq 0 ]; then
    echo "PASS $1"
    passed=$((passed + 1))
  else
    echo "FAIL $1"
    failed=$((failed + 1))
  fi
}

site_of() {  # the site-packages folder of a python
  "$1" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"
}

scratch_venv() {  # folder, site-packages to see (torch, numpy): a fresh venv, a .pth to it
  "$PY" -m venv "$1" || return 1
  site_of "$2" >"$(site_of "$1/bin/python")/_environment_torch.pth"
}

echo "sdist: $SDIST"

# 1. Every file a build needs.
"$PY" - "$SDIST" <<'EOF'
import subprocess, sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
tracked = subprocess.run(["git", "ls-files", "csrc", "ruda_torch"], capture_output=True,
                         text=True, check=True).stdout.split()
needed = set(tracked) | {"setup.py", "pyproject.toml", "README.md", "MANIFEST.in"}
missing = sorted(needed - names)
print(f"  {len(names)} files in the sdist; {len(needed)} needed; missing: {missing or 'none'}")
sys.exit(1 if missing else 0)
EOF
result "sdist holds every source and header (CUDA included)" $?

# 2. An isolated build stops at once, saying what to do.
scratch="$WORK/isolated"
"$PY" -m venv "$scratch"
start=$SECONDS
timeout 600 "$scratch/bin/python" -m pip install --no-deps "$SDIST" >"$WORK/isolated.log" 2>&1
rc=$?
took=$((SECONDS - start))
echo "  pip install <sdist> (isolated): exit $rc after ${took} s"
grep -q "no torch is importable" "$WORK/isolated.log" && grep -q -- "--no-build-isolation" "$WORK/isolated.log"
said=$?
[ "$rc" -ne 0 ] && [ "$said" -eq 0 ] && [ "$took" -lt 300 ]
result "an isolated build is refused with the --no-build-isolation message" $?

# 3. The wheel from the sdist, against the CPU torch, in a fresh venv.
WHEEL=$(ls "$ROOT/$WHEEL_DIR"/ruda_torch-*.whl 2>/dev/null | head -n 1)
[ -n "$WHEEL" ]
result "a wheel was built from the sdist ($(basename "${WHEEL:-none}"))" $?

SMOKE='
import sys, torch, ruda_torch
where = ruda_torch.__file__
assert sys.argv[1] in where, f"imported {where}, not the scratch install"
print("  ruda_torch from", where, "| torch", torch.__version__, "| backends",
      ruda_torch.compiled_backends(), "| CPU ISA", ruda_torch.cpu_capability())
torch.manual_seed(0)
ps = [torch.nn.Parameter(torch.randn(n)) for n in (97, 1025)]
qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
ours = ruda_torch.AdamW(ps, lr=1e-2, eps=1e-8, weight_decay=1e-2, fused_step=True,
                        hierarchical_stats=True)
theirs = torch.optim.AdamW(qs, lr=1e-2, eps=1e-8, weight_decay=1e-2, foreach=False)
for p, q in zip(ps, qs):
    p.grad = torch.randn_like(p); q.grad = p.grad.clone()
ours.step(); theirs.step()
for p, q in zip(ps, qs):
    torch.testing.assert_close(p, q, rtol=2e-6, atol=1e-7)
assert ours.last_report.nonfinite_count.item() == 0
print("  one fused step with statistics matches torch.optim.AdamW")
'
if [ -n "$WHEEL" ]; then
  venv="$WORK/wheel-venv"
  scratch_venv "$venv" "$CPU_VENV/bin/python" &&
    "$venv/bin/python" -m pip install -q --no-deps --ignore-installed "$WHEEL" &&
    (cd "$WORK" && "$venv/bin/python" -c "$SMOKE" "$venv")
  result "the wheel installs into a fresh venv, imports and steps" $?
else
  result "the wheel installs into a fresh venv, imports and steps" 1
fi

# 4. The same wheel under another torch release refuses to import.
if [ -n "$WHEEL" ]; then
  venv="$WORK/other-torch"
  scratch_venv "$venv" "$PY" && "$venv/bin/python" -m pip install -q --no-deps --ignore-installed "$WHEEL"
  (cd "$WORK" && "$venv/bin/python" -c "import ruda_torch") >"$WORK/other.log" 2>&1
  rc=$?
  grep -m 1 "^ImportError" "$WORK/other.log" | cut -c 1-200
  [ "$rc" -ne 0 ] && grep -q "was built against torch" "$WORK/other.log"
  result "under another torch release the import is refused, naming both" $?
else
  result "under another torch release the import is refused, naming both" 1
fi

echo "test-packaging: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
