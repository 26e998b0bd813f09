# Developer workflow for ruda_torch. `make help` lists the targets.
#
# Every target sets up what it needs from nothing and skips what is already done: stamp
# files in the virtual environment record what was installed and built, keyed on the
# files that decide it (requirements-*.txt, setup.py, pyproject.toml, csrc/ and the build
# switches of setup.py).
#
# Note [Incremental builds]: the first build (and any change to setup.py, pyproject.toml or
# the dependencies) runs `pip install --no-build-isolation -e .`. pip builds editable
# installs in a temporary folder, so it always compiles every file. After that, a change
# under csrc/ or to a build switch rebuilds with `setup.py build_ext --inplace`, which
# keeps its objects in build/ and recompiles only what changed (ninja); both put the
# extension at the same place, ruda_torch/_C*.so, where the editable install finds it.

PYTHON ?= python3
VENV ?= .venv
# NO_VENV=1: use $(PYTHON) and the packages already installed for it instead of creating
# $(VENV) (for a machine with torch preinstalled and no package registry).
NO_VENV ?=
PYTEST_ARGS ?=
# pytest-xdist workers of `make test`: auto (one per core) or a number; 0 runs serially.
# Measured on 2 cores: 87 s against 94 s serially (the kernels use both cores already).
PYTEST_WORKERS ?= auto
DEMO_ARGS ?=
BENCH_ARGS ?=
QUALITY_ARGS ?=

ifeq ($(NO_VENV),)
  PY := $(VENV)/bin/python
  BIN := $(VENV)/bin/
  STAMPS := $(VENV)
else
  PY := $(PYTHON)
  BIN :=
  STAMPS := build/stamps
endif
RUFF := $(BIN)ruff
CLANG_FORMAT := $(BIN)clang-format

LINT_STAMP := $(STAMPS)/.stamp-lint
DEPS_STAMP := $(STAMPS)/.stamp-deps
INSTALL_STAMP := $(STAMPS)/.stamp-install
FRESH_INSTALL := $(STAMPS)/.stamp-fresh-install
BUILD_CONFIG := $(STAMPS)/.stamp-build-config
BUILD_STAMP := $(STAMPS)/.stamp-build

# C++/CUDA sources: what the extension depends on and what clang-format checks.
CSRC := $(sort $(shell find csrc -type f \( -name '*.h' -o -name '*.hpp' -o -name '*.cuh' \
	-o -name '*.cpp' -o -name '*.cc' -o -name '*.cu' \) 2>/dev/null))
# The switches setup.py reads (see its docstring); changing one rebuilds the extension.
BUILD_SWITCHES := RUDA_TORCH_CUDA=$(RUDA_TORCH_CUDA) CUDA_HOME=$(CUDA_HOME) \
	TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST) RUDA_TORCH_CPU_ISA=$(RUDA_TORCH_CPU_ISA)

.DEFAULT_GOAL := help
.PHONY: help deps build test cpu-venv bench-states test-integrations test-cpu-torch sdist test-packaging test-cuda-sim check-cuda-static demo bench regressions gpu-check check format versions clean distclean FORCE

help:
	@echo "make test       set up .venv, build the extension, run the test suite"
	@echo "make demo       set up and build, then train a small MLP with torch's and our AdamW"
	@echo "make build      set up .venv and build the extension only"
	@echo "make bench      set up and build, then run benchmarks/bench_adamw.py"
	@echo "make bench-states  low-precision optimizer states: the step against torch and"
	@echo "                torchao (bench_state_precision.py), then the training-quality run"
	@echo "make test-integrations  install requirements-integrations.txt, requirements-torchtitan.txt"
	@echo "                and DeepSpeed into .venv (HF transformers, accelerate, Lightning, DeepSpeed,"
	@echo "                torchtitan) and run tests/integrations"
	@echo "make test-cpu-torch  build against the CPU-only torch 2.13.0 in .venv-cpu (CPU kernels"
	@echo "                only) and run the kernel, optimizer and distributed tests there"
	@echo "make test-cuda-sim  the CUDA kernels on an emulated device against the CPU kernels,"
	@echo "                with ASan, TSan and mutations (no GPU, no CUDA toolkit needed)"
	@echo "make check-cuda-static  every CUDA kernel compiled for sm_90 and sm_80: no spill,"
	@echo "                occupancy >= 50%, no unmarked 32-bit loads in loops (needs nvcc)"
	@echo "make sdist      build the sdist into build/sdist (python -m build, isolated)"
	@echo "make test-packaging  sdist contents, isolated-build refusal, a wheel from the sdist"
	@echo "                in a fresh venv (tools/check_packaging.sh)"
	@echo "make regressions  oracle + host suites through tools/run_adamw_regressions.py (JSON record)"
	@echo "make gpu-check  on a GPU machine: build, GPU tests, GPU benchmark (tools/gpu_check.sh)"
	@echo "make check      ruff check, ruff format --check, clang-format --dry-run over csrc/"
	@echo "make format     apply ruff (import order, format) and clang-format"
	@echo "make versions   print the versions of the tools in the environment"
	@echo "make clean      remove build outputs (keeps .venv); make distclean also removes .venv"
	@echo "Variables: PYTHON=$(PYTHON) VENV=$(VENV) NO_VENV=$(NO_VENV);"
	@echo "  PYTEST_ARGS, DEMO_ARGS, BENCH_ARGS pass arguments to pytest, the demo, the benchmark"

# ---------------------------------------------------------------------------- environment

ifeq ($(NO_VENV),)
$(PY):
	$(PYTHON) -m venv $(VENV)

$(LINT_STAMP): requirements-lint.txt | $(PY)
	$(PY) -m pip install -r requirements-lint.txt
	@touch $@

$(DEPS_STAMP): requirements-dev.txt requirements-lint.txt $(LINT_STAMP)
	$(PY) -m pip install -r requirements-dev.txt
	@touch $@
else
$(LINT_STAMP):
	@mkdir -p $(STAMPS)
	@command -v ruff >/dev/null && command -v clang-format >/dev/null \
		|| { echo "NO_VENV=1: ruff and clang-format must be on PATH" >&2; exit 1; }
	@touch $@

$(DEPS_STAMP):
	@mkdir -p $(STAMPS)
	$(PY) -c "import torch, pytest, setuptools; print('torch', torch.__version__, torch.__file__)"
	@touch $@
endif

deps: $(DEPS_STAMP)

# -------------------------------------------------------------------------------- build

$(INSTALL_STAMP): $(DEPS_STAMP) setup.py pyproject.toml
	$(PY) -m pip install --no-build-isolation --no-deps -v -e .
	@touch $(FRESH_INSTALL) $@

# Rewritten only when the list of sources or a build switch changes (or the built module
# is missing), so that its timestamp says when to rebuild.
$(BUILD_CONFIG): FORCE
	@mkdir -p $(STAMPS)
	@printf '%s\n' $(CSRC) '$(BUILD_SWITCHES)' > $@.tmp
	@if cmp -s $@.tmp $@ && [ -n "$(wildcard ruda_torch/_C*.so)" ]; then rm -f $@.tmp; \
	else mv -f $@.tmp $@; fi

# Note [Incremental builds].
$(BUILD_STAMP): $(INSTALL_STAMP) $(BUILD_CONFIG) $(CSRC)
	@if [ -f $(FRESH_INSTALL) ]; then rm -f $(FRESH_INSTALL); else \
		echo "$(PY) setup.py build_ext --inplace"; \
		$(PY) setup.py build_ext --inplace || exit 1; fi
	@touch $@

build: $(BUILD_STAMP)

# ---------------------------------------------------------------------------- run things

# pytest exits with 5 when it collects no tests: that is a failure too (make stops on any
# nonzero status). .ci/pytest_gpu_summary.py prints how many `gpu` tests were skipped.
test: $(BUILD_STAMP)
	@echo "$(PY) -m pytest tests -q -ra -n $(PYTEST_WORKERS) --ignore=tests/integrations --ignore=tests/test_cuda_sim.py $(PYTEST_ARGS)"
	@rc=0; PYTHONPATH=.ci$${PYTHONPATH:+:$$PYTHONPATH} \
		$(PY) -m pytest tests -q -ra -n $(PYTEST_WORKERS) -p pytest_gpu_summary \
		--ignore=tests/integrations --ignore=tests/test_cuda_sim.py $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; fi; \
	exit $$rc

# The trainers' packages go into .venv on top of the development ones (not into
# requirements-dev.txt: `make test` does not need them and stays smaller).
INTEGRATIONS_STAMP := $(STAMPS)/.stamp-integrations
# DeepSpeed (an sdist): built against .venv's torch, without its prebuilt ops.
DEEPSPEED_VERSION ?= 0.19.8
$(INTEGRATIONS_STAMP): requirements-integrations.txt requirements-deepspeed.txt \
		requirements-torchtitan.txt $(DEPS_STAMP)
	$(PY) -m pip install -r requirements-integrations.txt -r requirements-deepspeed.txt \
		-r requirements-torchtitan.txt
	DS_BUILD_OPS=0 $(PY) -m pip install --no-build-isolation --no-deps \
		deepspeed==$(DEEPSPEED_VERSION)
	@touch $@

test-integrations: $(BUILD_STAMP) $(INTEGRATIONS_STAMP)
	$(PY) -m pytest tests/integrations -q -ra $(PYTEST_ARGS)

demo: $(BUILD_STAMP)
	$(PY) examples/train_mlp.py --plot out/demo.png $(DEMO_ARGS)

bench: $(BUILD_STAMP)
	@if [ ! -f benchmarks/bench_adamw.py ]; then \
		echo "make bench: benchmarks/bench_adamw.py is not in this checkout" >&2; exit 1; fi
	$(PY) benchmarks/bench_adamw.py $(BENCH_ARGS)

# Low-precision optimizer states (Note [Low-precision states] in csrc/adamw_math.h): the
# bare step against torch's fused one and torchao's AdamW8bit, then the training-quality
# run on the standard library's sources (docs/performance.md). torchao goes into .venv.
BENCH_STAMP := $(STAMPS)/.stamp-bench
$(BENCH_STAMP): requirements-bench.txt $(DEPS_STAMP)
	$(PY) -m pip install --no-deps -r requirements-bench.txt
	@touch $@

bench-states: $(BUILD_STAMP) $(BENCH_STAMP)
	$(PY) benchmarks/bench_state_precision.py $(BENCH_ARGS)
	$(PY) benchmarks/quality_state_precision.py $(QUALITY_ARGS)

regressions: $(BUILD_STAMP)
	$(PY) tools/run_adamw_regressions.py --suite oracle --suite host

gpu-check:
	bash tools/gpu_check.sh

versions: $(DEPS_STAMP)
	@$(PY) -c "import sys, torch; print('python', sys.version.split()[0]); \
		print('torch', torch.__version__, '| CUDA build:', torch.version.cuda, \
		'| GPU visible:', torch.cuda.is_available())"
	@$(PY) -m pip list 2>/dev/null \
		| grep -iE '^(numpy|pytest|ninja|setuptools|wheel|ruff|clang-format) ' || true
	@$(CLANG_FORMAT) --version 2>/dev/null || echo "clang-format: not installed"

# ---------------------------------------------------------------------------- lint, format

check: $(LINT_STAMP)
	@rc=0; \
	echo "$(RUFF) check ."; $(RUFF) check . || rc=1; \
	echo "$(RUFF) format --check ."; $(RUFF) format --check . || rc=1; \
	if [ -n "$(CSRC)" ]; then \
		echo "$(CLANG_FORMAT) --dry-run -Werror <$(words $(CSRC)) files under csrc/>"; \
		$(CLANG_FORMAT) --dry-run -Werror $(CSRC) || rc=1; \
	else echo "clang-format: no C++/CUDA sources under csrc/"; fi; \
	if [ $$rc -ne 0 ]; then echo "make check: failed (make format fixes formatting)" >&2; fi; \
	exit $$rc

format: $(LINT_STAMP)
	$(RUFF) check --select I --fix .
	$(RUFF) format .
	$(if $(CSRC),$(CLANG_FORMAT) -i $(CSRC),@echo "clang-format: no C++/CUDA sources under csrc/")


# A CPU-only torch must build the CPU kernels alone (setup.py skips CUDA with a message).
# The build uses a copy of the sources under build/, so that it shares neither objects nor
# the in-place extension with the main environment, and the tests run from outside the
# repository so that they import the package installed in $(CPU_VENV).
CPU_VENV ?= .venv-cpu
CPU_TORCH ?= torch==2.13.0
# The kernels, the optimizer (coherence, dtypes, compile, exact checks, low-precision states)
# and the distributed setups on the older torch as well (FSDP1, FSDP2, DDP and ZeRO on gloo).
CPU_TESTS ?= tests/test_fixtures.py tests/test_stats.py tests/test_ops.py \
	tests/test_param_dtypes.py tests/test_optimizer.py tests/test_coherence.py \
	tests/test_optimizer_stats.py tests/test_optimizer_dtypes.py tests/test_compile.py \
	tests/test_distributed.py tests/test_flat_grads.py tests/test_cpu_isa.py \
	tests/test_exact_checks.py tests/test_state_precision.py tests/test_quant8.py \
	tests/test_state_8bit.py

$(CPU_VENV)/.stamp-deps:
	$(PYTHON) -m venv $(CPU_VENV)
	$(CPU_VENV)/bin/python -m pip install $(CPU_TORCH) numpy pytest pytest-xdist ninja setuptools \
		wheel
	@touch $@

# The CPU torch's environment alone: it does not depend on .venv, so .ci/run sets it up in
# the background while the main build and tests run.
cpu-venv: $(CPU_VENV)/.stamp-deps

# The sdist, built as maintainers do (`python -m build`, isolated: it needs no torch), once
# for the files it holds.
SDIST_STAMP := build/sdist/.stamp
$(SDIST_STAMP): $(DEPS_STAMP) setup.py pyproject.toml MANIFEST.in README.md $(CSRC) \
		$(wildcard ruda_torch/*.py) $(wildcard ruda_torch/integrations/*.py)
	rm -rf build/sdist
	$(PY) -m build --sdist --outdir build/sdist .
	@touch $@

sdist: $(SDIST_STAMP)

# A wheel built from the sdist (not from a copy of the tree: a file missing from the sdist
# fails here) against the CPU torch: what test-cpu-torch installs and test-packaging tries
# in fresh venvs.
CPU_WHEEL_STAMP := build/wheel-cpu/.stamp
$(CPU_WHEEL_STAMP): $(CPU_VENV)/.stamp-deps $(SDIST_STAMP)
	rm -rf build/wheel-cpu
	$(CPU_VENV)/bin/python -m pip wheel --no-build-isolation --no-deps -v -w build/wheel-cpu \
		build/sdist/ruda_torch-*.tar.gz
	@touch $@

test-cpu-torch: $(CPU_WHEEL_STAMP)
	$(CPU_VENV)/bin/python -m pip install --no-deps --force-reinstall build/wheel-cpu/ruda_torch-*.whl
	cd build && ../$(CPU_VENV)/bin/python -c "import torch, ruda_torch; \
		print('torch', torch.__version__, 'backends', ruda_torch.compiled_backends()); \
		assert ruda_torch.compiled_backends() == ('cpu',)"
	cd build && ../$(CPU_VENV)/bin/python -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) \
		$(addprefix ../,$(CPU_TESTS))

# Note [CUDA emulation] (csrc/cuda_sim/cuda_sim.h): the CUDA kernels built as C++ for an
# emulated device and compared bit for bit with the CPU kernels (tests/test_cuda_sim.py),
# then under AddressSanitizer, the concurrent schedule under ThreadSanitizer, and the
# mutations that must fail (tools/cuda_sim_mutations.py). Needs no GPU and no CUDA
# toolkit; the sanitizer runs preload the runtimes (Python is not built with them).
SIM_BUILD = $(PY) -c "import sys; sys.path.insert(0, 'tests/cuda_sim'); from build import load; \
	load()" 2>/dev/null || true
ASAN_LIB = $(shell $(CXX) -print-file-name=libasan.so)
TSAN_LIB = $(shell $(CXX) -print-file-name=libtsan.so)
test-cuda-sim: $(BUILD_STAMP)
	$(SIM_BUILD)
	$(PY) -m pytest tests/test_cuda_sim.py -q -p no:cacheprovider -n $(PYTEST_WORKERS)
	RUDA_CUDA_SIM_SANITIZE=address $(SIM_BUILD)
	PYTHONPATH=tests/cuda_sim/no_triton RUDA_CUDA_SIM_SANITIZE=address \
		LD_PRELOAD=$(ASAN_LIB) ASAN_OPTIONS=detect_leaks=0 \
		$(PY) -m pytest tests/test_cuda_sim.py -q -p no:cacheprovider -n $(PYTEST_WORKERS) -k forward
	RUDA_CUDA_SIM_SANITIZE=thread $(SIM_BUILD)
	RUDA_CUDA_SIM_SANITIZE=thread LD_PRELOAD=$(TSAN_LIB) \
		TSAN_OPTIONS="halt_on_error=1 exitcode=66 report_signal_unsafe=0" \
		$(PY) -m pytest tests/test_cuda_sim.py -q -p no:cacheprovider \
		-k "concurrent and (analyze or merge or 8bit or 4bit)"
	$(PY) tools/cuda_sim_mutations.py

# The CUDA kernels' static check (tools/check_cuda_static.py, docs/building.md): compiled
# for sm_90 and sm_80 with the build's flags, disassembled with nvdisasm (pip's
# nvidia-cuda-nvdisasm, in requirements-dev.txt), held to no spill, occupancy >= 50% and no
# 32-bit global load in a loop that its source line does not explain.
check-cuda-static: $(DEPS_STAMP)
	$(PY) tools/check_cuda_static.py

# tools/check_packaging.sh: the sdist's contents, the isolated-build refusal, the wheel
# built from the sdist in a fresh venv, and its import refused under another torch (.venv's).
test-packaging: $(BUILD_STAMP) $(SDIST_STAMP) $(CPU_WHEEL_STAMP)
	bash tools/check_packaging.sh $(PY) $(CPU_VENV) build/wheel-cpu

# -------------------------------------------------------------------------------- cleanup

clean:
	rm -rf build ruda_torch/_*.so .pytest_cache .ruff_cache
	rm -f $(INSTALL_STAMP) $(FRESH_INSTALL) $(BUILD_CONFIG) $(BUILD_CONFIG).tmp $(BUILD_STAMP)
	find ruda_torch tests examples benchmarks tools .ci -name __pycache__ -type d -prune \
		-exec rm -rf {} + 2>/dev/null || true

distclean: clean
ifeq ($(NO_VENV),)
	rm -rf $(VENV)
endif

FORCE:
