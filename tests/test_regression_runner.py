"""tools/run_adamw_regressions.py: the run record's format and the passed / failed /
blocked / timeout decisions. Nothing is built and no suite really runs: the toolchain
queries, the probe of the target Python and the command runner are monkeypatched. Needs
neither the native extension nor a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def _load_runner():
    # tools/ is not a package: load the file. Registered in sys.modules before running
    # it, as dataclasses need.
    name = "run_adamw_regressions_file"
    spec = importlib.util.spec_from_file_location(
        name, REPO_ROOT / "tools" / "run_adamw_regressions.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


runner = _load_runner()

GOOD_PROBE = {
    "python": "3.11.0",
    "has_torch": True,
    "has_pytest": True,
    "has_pip": True,
    "torch": "2.14.1",
    "torch_cuda": "13.0",
    "cuda_available": True,
    "cuda_device_count": 1,
    "ruda_torch_backends": ["cpu", "cuda"],
}
RECORD_KEYS = {
    "run_id",
    "runner",
    "command_line",
    "suites",
    "offline",
    "timeout_s",
    "passthrough",
    "started",
    "finished",
    "status",
    "python",
    "environment",
    "git",
    "source_hashes",
    "source_tree_sha256",
    "artifact_hashes_after",
    "commands",
}
COMMAND_KEYS = {
    "suite",
    "name",
    "argv",
    "env",
    "started",
    "finished",
    "duration_s",
    "exit_code",
    "status",
    "reason",
    "log",
    "details",
}


@pytest.fixture
def fake(monkeypatch):
    """A toolchain with everything, and a command runner that only records."""
    state = {"probe": dict(GOOD_PROBE), "exit": {}, "ran": []}
    monkeypatch.setattr(runner, "probe_python", lambda python, timeout, env: dict(state["probe"]))
    monkeypatch.setattr(runner, "which_compiler", lambda: "c++")
    monkeypatch.setattr(runner, "which_nvcc", lambda: "nvcc")

    def fake_run_command(step, log_path, timeout, echo=True):
        state["ran"].append(step)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        text = "[ruda_torch build] building CPU and CUDA kernels\n"
        text += "compiled_backends ('cpu', 'cuda') cpu_isa avx2\n"
        text += "3 passed in 0.1s\n" if step.suite == "cuda" else ""
        log_path.write_text(text)
        code = state["exit"].get(step.name, 0)
        return runner.CommandRecord(
            suite=step.suite,
            name=step.name,
            argv=runner.display_argv(step.argv),
            env=step.env,
            started=runner.now_iso(),
            finished=runner.now_iso(),
            duration_s=0.01,
            exit_code=code,
            status="passed" if code in step.ok_codes else "failed",
            reason=None if code == 0 else f"exit status {code}",
            log=runner.rel(log_path),
        )

    monkeypatch.setattr(runner, "run_command", fake_run_command)
    return state


def run_main(tmp_path, *args):
    out = tmp_path / "out"
    code = runner.main([*args, "--out", str(out)])
    records = sorted(out.glob("*.json"))
    assert len(records) == 1, records
    return code, json.loads(records[0].read_text())


def test_record_format(fake, tmp_path):
    code, rec = run_main(tmp_path, "--suite", "oracle", "--suite", "host", "--timeout", "7")
    assert code == 0
    assert set(rec) == RECORD_KEYS
    assert rec["status"] == "passed"
    assert rec["suites"] == ["oracle", "host"]
    assert rec["timeout_s"] == 7.0
    assert rec["command_line"][:2] == ["python", "tools/run_adamw_regressions.py"]
    assert [c["suite"] for c in rec["commands"]] == ["oracle", "host"]
    for cmd in rec["commands"]:
        assert set(cmd) == COMMAND_KEYS
        assert cmd["status"] in runner.STATUSES
        assert cmd["argv"][1:3] == ["-m", "pytest"]
        assert not os.path.isabs(cmd["argv"][0]), cmd["argv"]
        assert Path(cmd["log"]).is_file()
    assert rec["commands"][1]["argv"][3:6] == ["tests", "-m", "not gpu"]
    # Source hashes: every requested tree, sha256 hex digests, artifacts kept apart.
    keys = rec["source_hashes"]
    assert "setup.py" in keys and "pyproject.toml" in keys
    assert any(k.startswith("csrc/") for k in keys)
    assert "ruda_torch/optimizer.py" in keys
    assert not any(k.endswith(".so") or "__pycache__" in k for k in keys)
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in keys.values())
    assert rec["source_tree_sha256"] == runner.combined_hash(keys)


def test_failed_command_fails_the_run(fake, tmp_path):
    fake["exit"]["pytest-fixtures"] = 1
    code, rec = run_main(tmp_path, "--suite", "reference")
    assert code == 1
    assert rec["status"] == "failed"
    assert rec["commands"][0]["exit_code"] == 1


def test_build_blocked_without_compiler(fake, monkeypatch, tmp_path):
    monkeypatch.setattr(runner, "which_compiler", lambda: None)
    code, rec = run_main(tmp_path, "--suite", "build")
    assert code == runner.EXIT_CODES["blocked"] == 3
    (cmd,) = rec["commands"]
    assert cmd["status"] == "blocked" and cmd["exit_code"] is None and cmd["log"] is None
    assert "C++ compiler" in cmd["reason"]
    assert fake["ran"] == []


def test_build_then_import_check(fake, monkeypatch, tmp_path):
    monkeypatch.delenv("RUDA_TORCH_CUDA", raising=False)
    code, rec = run_main(tmp_path, "--suite", "build", "--offline")
    assert code == 0
    build, check = rec["commands"]
    assert build["argv"][1:4] == ["-m", "pip", "install"]
    assert "--no-build-isolation" in build["argv"] and "--no-index" in build["argv"]
    assert build["env"]["RUDA_TORCH_CUDA"] == "auto"
    assert build["env"]["PIP_NO_INDEX"] == "1"
    assert build["details"]["build_messages"] == [
        "[ruda_torch build] building CPU and CUDA kernels"
    ]
    assert "compiled_backends" in check["details"]["compiled_backends"]


def test_failed_build_skips_import_check(fake, tmp_path):
    fake["exit"]["pip-install-editable"] = 1
    code, rec = run_main(tmp_path, "--suite", "build")
    assert code == 1
    assert [c["name"] for c in rec["commands"]] == ["pip-install-editable"]


def test_reference_blocked_when_extension_missing_and_no_compiler(fake, monkeypatch, tmp_path):
    fake["probe"].pop("ruda_torch_backends")
    fake["probe"]["ruda_torch_error"] = "ImportError: no module named ruda_torch._C"
    monkeypatch.setattr(runner, "which_compiler", lambda: None)
    code, rec = run_main(tmp_path, "--suite", "reference")
    assert code == 3 and rec["commands"][0]["status"] == "blocked"
    assert "not importable" in rec["commands"][0]["reason"]


def test_reference_runs_and_fails_when_extension_missing_but_buildable(fake, tmp_path):
    # A compiler exists: the suite runs (and its import fails inside pytest); the runner
    # does not build anything on its own.
    fake["probe"]["ruda_torch_error"] = "ImportError"
    fake["exit"]["pytest-fixtures"] = 2
    code, rec = run_main(tmp_path, "--suite", "reference")
    assert code == 1 and [s.name for s in fake["ran"]] == ["pytest-fixtures"]


def test_missing_torch_blocks(fake, tmp_path):
    fake["probe"] = {"python": "3.11", "has_torch": False, "has_pytest": True}
    code, rec = run_main(tmp_path, "--suite", "oracle")
    assert code == 3 and "torch is not importable" in rec["commands"][0]["reason"]


def test_cuda_blocked_without_toolchain(fake, monkeypatch, tmp_path):
    fake["probe"].update(torch_cuda=None, cuda_available=False)
    monkeypatch.setattr(runner, "which_nvcc", lambda: None)
    code, rec = run_main(tmp_path, "--suite", "cuda")
    assert code == 3
    assert rec["commands"][0]["status"] == "blocked"
    assert "nvcc" in rec["commands"][0]["reason"]


@pytest.mark.parametrize("torch_cuda", ["13.0", None])
def test_cuda_fails_without_gpu(fake, torch_cuda, tmp_path):
    # A CUDA torch (or an nvcc) but no visible GPU: failed, never skipped or blocked.
    fake["probe"].update(torch_cuda=torch_cuda, cuda_available=False, cuda_device_count=0)
    code, rec = run_main(tmp_path, "--suite", "cuda")
    assert code == 1
    (cmd,) = rec["commands"]
    assert cmd["status"] == "failed"
    assert "is_available() is False" in cmd["reason"]
    assert fake["ran"] == []


def test_cuda_fails_without_cuda_kernels(fake, tmp_path):
    fake["probe"]["ruda_torch_backends"] = ["cpu"]
    code, rec = run_main(tmp_path, "--suite", "cuda")
    assert code == 1
    assert "no CUDA kernels" in rec["commands"][0]["reason"]


def test_cuda_runs_gpu_tests(fake, tmp_path):
    code, rec = run_main(tmp_path, "--suite", "cuda")
    assert code == 0
    (cmd,) = rec["commands"]
    assert cmd["argv"][3:] == ["tests", "-m", "gpu", "-q", "-ra"]
    assert cmd["details"]["pytest_counts"] == {"passed": 3}


def test_bench_passthrough(fake, tmp_path):
    extra = ["--elements", "65536", "--grad-dtype", "bfloat16", "--iterations", "20"]
    extra += ["--samples", "7", "--amsgrad"]
    code, rec = run_main(tmp_path, "--suite", "bench", *extra)
    assert code == 0
    (cmd,) = rec["commands"]
    assert cmd["argv"][1] == "benchmarks/bench_adamw.py"
    assert cmd["argv"][2 : 2 + len(extra)] == extra
    assert "--json" in cmd["argv"]
    assert rec["passthrough"] == extra


def test_extra_arguments_need_bench():
    with pytest.raises(SystemExit) as e:
        runner.parse_args(["--suite", "host", "--elements", "5"])
    assert e.value.code == 2


def test_overall_status_precedence():
    assert runner.overall_status(["passed", "passed"]) == "passed"
    assert runner.overall_status(["passed", "blocked"]) == "blocked"
    assert runner.overall_status(["blocked", "failed"]) == "failed"
    assert runner.overall_status(["failed", "timeout"]) == "timeout"
    assert runner.overall_status([]) == "failed"


# The real command runner, on tiny Python commands (well under a second each).
def _step(code: str, **kw):
    return runner.Step("host", "tiny", [sys.executable, "-c", code], **kw)


def test_run_command_statuses(tmp_path):
    ok = runner.run_command(_step("print('hello')"), tmp_path / "ok.log", 60, echo=False)
    assert (ok.status, ok.exit_code, ok.reason) == ("passed", 0, None)
    assert "hello" in (tmp_path / "ok.log").read_text()
    bad = runner.run_command(_step("raise SystemExit(3)"), tmp_path / "bad.log", 60, echo=False)
    assert (bad.status, bad.exit_code) == ("failed", 3) and "exit status 3" in bad.reason
    assert bad.duration_s >= 0 and bad.started <= bad.finished


def test_run_command_timeout_kills(tmp_path):
    slow = _step("import time; time.sleep(60)")
    rec = runner.run_command(slow, tmp_path / "slow.log", 0.5, echo=False)
    assert rec.status == "timeout"
    assert rec.duration_s < 30
    assert "--timeout" in rec.reason


def test_run_command_env_and_display(tmp_path):
    step = _step("import os; print(os.environ['RUDA_X'])", env={"RUDA_X": "42"})
    rec = runner.run_command(step, tmp_path / "env.log", 60, echo=False)
    assert rec.status == "passed" and rec.env == {"RUDA_X": "42"}
    assert "42" in (tmp_path / "env.log").read_text()
    assert not os.path.isabs(rec.argv[0])


def test_build_probes_again_after_building(fake, monkeypatch, tmp_path):
    calls = []

    def probe(python, timeout, env):
        calls.append(1)
        return dict(fake["probe"], probes=len(calls))

    monkeypatch.setattr(runner, "probe_python", probe)
    code, rec = run_main(tmp_path, "--suite", "build")
    assert code == 0
    # The record's environment is the one after the build, not the one before it.
    assert rec["environment"]["probes"] == len(calls) == 2


def test_display_argv_names_no_machine_folders():
    inside = str(REPO_ROOT / "benchmarks" / "bench_adamw.py")
    shown = runner.display_argv(["/nonexistent/bin/python3", inside, "--elements", "5"])
    assert shown == ["python3", "benchmarks/bench_adamw.py", "--elements", "5"]
    assert runner.scrub(f"error in {REPO_ROOT}/ruda_torch/x.py") == "error in ./ruda_torch/x.py"
