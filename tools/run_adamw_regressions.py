#!/usr/bin/env python3
"""Run ruda_torch's regression suites and keep a JSON record of what ran.

Suites (``--suite``, repeatable):

  oracle     tests/test_reference.py: the FP64 reference against torch.optim.AdamW and
             the fixtures' freshness. Pure Python; runs without the native extension.
  reference  tests/test_fixtures.py: the native kernels against the committed fixtures
             and the FP64 reference (needs the built extension).
  host       the whole CPU test suite: ``pytest tests -m "not gpu"``.
  build      a from-source build, ``pip install --no-build-isolation --no-deps -e .``
             with RUDA_TORCH_CUDA=auto, then an import check printing
             ``ruda_torch.compiled_backends()``.
  cuda       ``pytest tests -m gpu``. FAILS (status "failed", exit 1) when
             ``torch.cuda.is_available()`` is False or the build has no CUDA kernels:
             an explicit hardware suite never passes by skipping.
  bench      benchmarks/bench_adamw.py; every argument this runner does not know is
             passed to it (e.g. ``--elements 65536 --grad-dtype bfloat16 --iterations 20
             --samples 7 --amsgrad``).

A missing toolchain is status "blocked" with the reason: no C++ compiler (``c++`` or
$CXX) for build, or for a suite that needs the extension when it is not built; no
``nvcc`` and no CUDA build of torch for cuda; no importable torch/pytest. Nothing here
builds, installs or switches backend as a side effect of another suite.

Every run writes ``<out>/<run id>.json``: the command line, the suites, start and end
times, and for each command its argv, environment overrides, start/end time, duration,
exit code, status (passed/failed/blocked/timeout), reason, and the path of its log
(``<out>/<run id>/<n>-<name>.log``); plus sha256 hashes of the sources (csrc/**,
ruda_torch/**, setup.py, pyproject.toml; built artifacts such as ruda_torch/_C*.so are
hashed separately, after the run). Paths inside the repository are recorded relative to
it.

Exit status: 0 when every command passed, 1 when one failed or timed out, 3 when a suite
was blocked (and nothing failed), 2 for bad arguments.

``--offline`` makes pip never use the network (``--no-index``, PIP_NO_INDEX=1 for every
command); the suites themselves use none. ``--timeout`` bounds each command (not a
predicted runtime): past it the command's process group is killed and its status is
"timeout".
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SUITES = ("oracle", "reference", "host", "build", "cuda", "bench")
SOURCE_GLOBS = ("csrc/**/*", "ruda_torch/**/*", "setup.py", "pyproject.toml")
ARTIFACT_SUFFIXES = (".so", ".pyd", ".dll", ".dylib", ".pyc")
STATUSES = ("passed", "failed", "blocked", "timeout")
EXIT_CODES = {"passed": 0, "failed": 1, "timeout": 1, "blocked": 3}

# Asked of the Python that runs the suites (it may differ from the runner's own).
PROBE_CODE = r"""
import importlib.util, json, shutil, sys
info = {"python": sys.version.split()[0]}
for mod in ("torch", "pytest", "pip", "numpy", "ninja"):
    info["has_" + mod] = importlib.util.find_spec(mod) is not None
try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = bool(torch.cuda.is_available())
    info["cuda_device_count"] = torch.cuda.device_count() if info["cuda_available"] else 0
    if info["cuda_available"]:
        info["gpu_name"] = torch.cuda.get_device_name(0)
except Exception as e:
    info["torch_error"] = f"{type(e).__name__}: {e}"
try:
    import ruda_torch
    info["ruda_torch_backends"] = list(ruda_torch.compiled_backends())
except Exception as e:
    info["ruda_torch_error"] = f"{type(e).__name__}: {e}"
print("PROBE " + json.dumps(info))
"""


@dataclass
class Step:
    """One command of a suite."""

    suite: str
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    # The exit status that counts as passing (pytest: 0; 5 means nothing was collected).
    ok_codes: tuple[int, ...] = (0,)


@dataclass
class CommandRecord:
    suite: str
    name: str
    argv: list[str]
    env: dict[str, str]
    started: str | None
    finished: str | None
    duration_s: float | None
    exit_code: int | None
    status: str
    reason: str | None
    log: str | None
    details: dict = field(default_factory=dict)


# -------------------------------------------------------------------------------- helpers


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def rel(path: Path | str) -> str:
    """``path`` relative to the repository when inside it (no machine paths in records)."""
    p = Path(os.path.abspath(path))  # symlinks kept: .venv/bin/python stays in the repository
    for candidate in (p, p.resolve()):
        try:
            return candidate.relative_to(REPO_ROOT).as_posix()
        except ValueError:
            continue
    return str(path)


def display_argv(argv: list[str]) -> list[str]:
    """``argv`` as recorded: absolute paths relative to the repository, or their base name
    when outside it (the records name no folder of the machine they ran on)."""
    out = []
    for a in argv:
        if os.path.isabs(a):
            shown = rel(a)
            out.append(shown if not os.path.isabs(shown) else os.path.basename(a))
        else:
            out.append(a)
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def hash_tree(root: Path = REPO_ROOT) -> tuple[dict[str, str], dict[str, str]]:
    """(source hashes, artifact hashes) of SOURCE_GLOBS, keyed by relative path."""
    sources, artifacts = {}, {}
    seen = set()
    for pattern in SOURCE_GLOBS:
        for path in sorted(root.glob(pattern)):
            if not path.is_file() or "__pycache__" in path.parts or path in seen:
                continue
            seen.add(path)
            key = path.relative_to(root).as_posix()
            if path.name.endswith(ARTIFACT_SUFFIXES):
                artifacts[key] = sha256_file(path)
            else:
                sources[key] = sha256_file(path)
    return sources, artifacts


def combined_hash(hashes: dict[str, str]) -> str:
    h = hashlib.sha256()
    for key in sorted(hashes):
        h.update(f"{key}\0{hashes[key]}\n".encode())
    return h.hexdigest()


def git_state(root: Path = REPO_ROOT) -> dict:
    if shutil.which("git") is None:
        return {}
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=20
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit or None, "dirty": bool(dirty)}


def which_compiler() -> str | None:
    """The C++ compiler a build would use: $CXX, else ``c++`` on PATH."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx.split()[0])
    return shutil.which("c++")


def which_nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def probe_python(python: str, timeout: float, env: dict[str, str]) -> dict:
    """What ``python`` has: torch (and its CUDA), pytest, pip, ruda_torch's backends."""
    try:
        proc = subprocess.run(
            [python, "-c", PROBE_CODE],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=min(timeout, 300),
            env={**os.environ, **env},
        )
    except (OSError, subprocess.SubprocessError) as e:
        return {"probe_error": f"{type(e).__name__}: {e}"}
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE "):
            info = json.loads(line[len("PROBE ") :])
            return {k: scrub(v) if isinstance(v, str) else v for k, v in info.items()}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"probe_error": scrub(f"exit {proc.returncode}: {' | '.join(tail)}")}


def scrub(text: str) -> str:
    """``text`` with the repository's folder written as ``.`` (records name no folders of
    the machine they ran on)."""
    return text.replace(str(REPO_ROOT), ".")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()


def run_command(step: Step, log_path: Path, timeout: float, echo: bool = True) -> CommandRecord:
    """Run one step with stdout and stderr going to ``log_path``; its own process group,
    killed past ``timeout`` seconds."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = now_iso()
    t0 = time.monotonic()
    status, reason, code = "failed", None, None
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        log.write(f"$ {' '.join(display_argv(step.argv))}\n")
        if step.env:
            log.write(f"# environment: {json.dumps(step.env)}\n")
        log.flush()
        try:
            proc = subprocess.Popen(
                step.argv,
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **step.env},
                start_new_session=True,
            )
        except OSError as e:
            reason = f"could not start: {e}"
            log.write(reason + "\n")
            proc = None
        if proc is not None:
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                code = proc.returncode
                status = "timeout"
                reason = f"did not finish within --timeout {timeout:g} s; process group killed"
                log.write(f"\n# {reason}\n")
            except KeyboardInterrupt:
                _kill_group(proc)
                raise
    duration = time.monotonic() - t0
    if status != "timeout" and proc is not None:
        if code in step.ok_codes:
            status = "passed"
        else:
            status = "failed"
            reason = f"exit status {code}" + (
                " (pytest collected no tests)"
                if code == 5 and step.argv[1:3] == ["-m", "pytest"]
                else ""
            )
    rec = CommandRecord(
        suite=step.suite,
        name=step.name,
        argv=display_argv(step.argv),
        env=step.env,
        started=started,
        finished=now_iso(),
        duration_s=round(duration, 3),
        exit_code=code,
        status=status,
        reason=reason,
        log=rel(log_path),
    )
    if echo:
        print(
            f"[{step.suite}] {step.name}: {status} ({duration:.1f} s"
            + (f", {reason}" if reason else "")
            + f") log: {rec.log}",
            flush=True,
        )
        if status != "passed":
            _print_tail(log_path)
    return rec


def _print_tail(log_path: Path, lines: int = 25) -> None:
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return
    for line in text[-lines:]:
        print(f"    | {line}")


def not_run(suite: str, name: str, argv: list[str], status: str, reason: str) -> CommandRecord:
    """A record for a command that was not started (blocked, or a precondition failed)."""
    stamp = now_iso()
    print(f"[{suite}] {name}: {status}: {reason}", flush=True)
    return CommandRecord(
        suite=suite,
        name=name,
        argv=display_argv(argv),
        env={},
        started=stamp,
        finished=stamp,
        duration_s=0.0,
        exit_code=None,
        status=status,
        reason=reason,
        log=None,
    )


# --------------------------------------------------------------------------------- suites


def pytest_argv(python: str, *args: str) -> list[str]:
    return [python, "-m", "pytest", *args, "-q", "-ra"]


def _pytest_counts(log_path: Path) -> dict:
    """Counts from pytest's final summary line (passed, failed, skipped, ...)."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {}
    counts = {}
    lines = [
        ln
        for ln in text.splitlines()
        if re.search(r"\b(passed|failed|skipped|error|no tests ran)\b", ln)
    ]
    if lines:
        for num, what in re.findall(
            r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)", lines[-1]
        ):
            counts[what.rstrip("s") if what.startswith("error") else what] = int(num)
    return counts


class Runner:
    def __init__(self, args, passthrough: list[str]):
        self.args = args
        self.passthrough = passthrough
        self.python = args.python
        self.python_shown = display_argv([args.python])[0]
        self.run_id = _dt.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + "-".join(args.suites)
        self.out = Path(args.out)
        if not self.out.is_absolute():
            self.out = REPO_ROOT / self.out
        self.log_dir = self.out / self.run_id
        self.env = {"PIP_NO_INDEX": "1"} if args.offline else {}
        self.records: list[CommandRecord] = []
        self.counter = 0
        self._probe: dict | None = None

    # -- plumbing
    def probe(self) -> dict:
        if self._probe is None:
            self._probe = probe_python(self.python, self.args.timeout, self.env)
        return self._probe

    def run(self, step: Step) -> CommandRecord:
        self.counter += 1
        step.env = {**self.env, **step.env}
        log = self.log_dir / f"{self.counter:02d}-{step.suite}-{step.name}.log"
        rec = run_command(step, log, self.args.timeout)
        self.records.append(rec)
        return rec

    def block(self, suite: str, name: str, argv: list[str], reason: str) -> None:
        self.records.append(not_run(suite, name, argv, "blocked", reason))

    def fail(self, suite: str, name: str, argv: list[str], reason: str) -> None:
        self.records.append(not_run(suite, name, argv, "failed", reason))

    def _python_blocker(self, need_pytest: bool = True) -> str | None:
        info = self.probe()
        if "probe_error" in info:
            return f"cannot run {self.python_shown}: {info['probe_error']}"
        if not info.get("has_torch") or "torch_error" in info:
            return f"torch is not importable with {self.python_shown} ({info.get('torch_error', 'not installed')})"
        if need_pytest and not info.get("has_pytest"):
            return f"pytest is not installed for {self.python_shown}"
        return None

    def _extension_blocker(self) -> str | None:
        """Blocked when the extension is not importable and nothing could build it."""
        info = self.probe()
        if "ruda_torch_error" in info and which_compiler() is None:
            return (
                "the native extension is not importable "
                f"({info['ruda_torch_error']}) and no C++ compiler (c++ or $CXX) is on PATH "
                "to build it"
            )
        return None

    # -- suites
    def suite_oracle(self) -> None:
        argv = pytest_argv(self.python, "tests/test_reference.py")
        reason = self._python_blocker()
        if reason:
            return self.block("oracle", "pytest-reference", argv, reason)
        self.run(Step("oracle", "pytest-reference", argv))

    def suite_reference(self) -> None:
        argv = pytest_argv(self.python, "tests/test_fixtures.py")
        reason = self._python_blocker() or self._extension_blocker()
        if reason:
            return self.block("reference", "pytest-fixtures", argv, reason)
        self.run(Step("reference", "pytest-fixtures", argv))

    def suite_host(self) -> None:
        argv = pytest_argv(self.python, "tests", "-m", "not gpu")
        reason = self._python_blocker() or self._extension_blocker()
        if reason:
            return self.block("host", "pytest-cpu", argv, reason)
        self.run(Step("host", "pytest-cpu", argv))

    def suite_build(self) -> None:
        pip = [self.python, "-m", "pip", "install", "--no-build-isolation", "--no-deps"]
        if self.args.offline:
            pip.append("--no-index")
        pip += ["-v", "-e", "."]
        check = [
            self.python,
            "-c",
            "import ruda_torch; from ruda_torch import _build; "
            "print('compiled_backends', ruda_torch.compiled_backends(), 'cpu_isa', _build.CPU_ISA)",
        ]
        reason = self._python_blocker(need_pytest=False)
        if reason is None and which_compiler() is None:
            reason = "no C++ compiler: neither $CXX nor c++ is on PATH"
        if reason is None and not self.probe().get("has_pip"):
            reason = f"pip is not installed for {self.python_shown}"
        if reason:
            self.block("build", "pip-install-editable", pip, reason)
            return
        # RUDA_TORCH_CUDA=auto unless the caller set it (e.g. 1 on a GPU machine).
        want_cuda = os.environ.get("RUDA_TORCH_CUDA", "auto")
        rec = self.run(
            Step("build", "pip-install-editable", pip, env={"RUDA_TORCH_CUDA": want_cuda})
        )
        # setup.py runs more than once under pip: keep each message once, in order.
        messages = _grep_log(rec.log, r"\[ruda_torch build\].*")
        rec.details["build_messages"] = [scrub(m) for m in dict.fromkeys(messages)]
        self._probe = None  # the build changed what the Python has: ask again when needed
        if rec.status != "passed":
            return
        rec = self.run(Step("build", "import-check", check))
        found = _grep_log(rec.log, r"compiled_backends .*")
        rec.details["compiled_backends"] = found[-1] if found else None
        self.probe()  # the record's environment is the one after the build

    def suite_cuda(self) -> None:
        argv = pytest_argv(self.python, "tests", "-m", "gpu")
        reason = self._python_blocker()
        info = self.probe()
        if reason is None and not info.get("torch_cuda") and which_nvcc() is None:
            reason = (
                f"no CUDA toolchain: torch {info.get('torch')} is a CPU-only build and no "
                "nvcc is on PATH (or in $CUDA_HOME)"
            )
        if reason:
            return self.block("cuda", "pytest-gpu", argv, reason)
        if not info.get("cuda_available"):
            return self.fail(
                "cuda",
                "pytest-gpu",
                argv,
                "torch.cuda.is_available() is False: no GPU is visible, and the explicit CUDA "
                "suite does not pass by skipping",
            )
        if "cuda" not in info.get("ruda_torch_backends", []):
            why = info.get("ruda_torch_error") or (
                f"compiled backends: {', '.join(info.get('ruda_torch_backends', []))}"
            )
            return self.fail(
                "cuda",
                "pytest-gpu",
                argv,
                f"ruda_torch has no CUDA kernels ({why}); rebuild with RUDA_TORCH_CUDA=1 "
                "(--suite build with RUDA_TORCH_CUDA=1 in the environment, or make build)",
            )
        rec = self.run(Step("cuda", "pytest-gpu", argv))
        counts = _pytest_counts(REPO_ROOT / rec.log) if rec.log else {}
        rec.details["pytest_counts"] = counts
        if rec.status == "passed" and counts.get("passed", 0) == 0:
            rec.status = "failed"
            rec.reason = "no gpu test passed (all skipped or none collected)"
            print(f"[cuda] pytest-gpu: failed: {rec.reason}")

    def suite_bench(self) -> None:
        argv = [self.python, "benchmarks/bench_adamw.py", *self.passthrough]
        if "--json" not in self.passthrough:
            argv += ["--json", rel(self.log_dir / "bench.json")]
        reason = self._python_blocker(need_pytest=False) or self._extension_blocker()
        if reason:
            return self.block("bench", "bench-adamw", argv, reason)
        self.run(Step("bench", "bench-adamw", argv))

    # -- the record
    def execute(self) -> dict:
        started = now_iso()
        sources, _ = hash_tree()
        print(
            f"run {self.run_id}: suites {', '.join(self.args.suites)}; logs in {rel(self.log_dir)}"
        )
        try:
            for suite in self.args.suites:
                getattr(self, f"suite_{suite}")()
        finally:
            record = self.record(started, sources)
            self.out.mkdir(parents=True, exist_ok=True)
            path = self.out / f"{self.run_id}.json"
            path.write_text(json.dumps(record, indent=1) + "\n")
            print(f"record: {rel(path)}: {record['status']}")
        return record

    def record(self, started: str, sources: dict[str, str]) -> dict:
        _, artifacts = hash_tree()
        statuses = [r.status for r in self.records]
        return {
            "run_id": self.run_id,
            "runner": rel(Path(__file__)),
            "command_line": ["python", rel(Path(__file__)), *sys.argv[1:]],
            "suites": list(self.args.suites),
            "offline": bool(self.args.offline),
            "timeout_s": self.args.timeout,
            "passthrough": self.passthrough,
            "started": started,
            "finished": now_iso(),
            "status": overall_status(statuses),
            "python": display_argv([self.python])[0],
            "environment": self._probe or {},
            "git": git_state(),
            "source_hashes": sources,
            "source_tree_sha256": combined_hash(sources),
            "artifact_hashes_after": artifacts,
            "commands": [asdict(r) for r in self.records],
        }


def _grep_log(log: str | None, pattern: str) -> list[str]:
    if not log:
        return []
    path = Path(log) if os.path.isabs(log) else REPO_ROOT / log
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return re.findall(pattern, text)


def overall_status(statuses: list[str]) -> str:
    if not statuses:
        return "failed"
    for status in ("timeout", "failed", "blocked"):
        if status in statuses:
            return status
    return "passed"


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Run ruda_torch's regression suites and record them in JSON.",
        epilog="Arguments not listed here are passed to benchmarks/bench_adamw.py (--suite bench).",
        allow_abbrev=False,
    )
    p.add_argument(
        "--suite",
        dest="suites",
        action="append",
        choices=SUITES,
        required=True,
        help="suite to run (repeat for several, run in the order given)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per command")
    p.add_argument("--offline", action="store_true", help="no network: pip steps use --no-index")
    p.add_argument("--out", default="out/regressions", help="folder for the record and logs")
    p.add_argument(
        "--python",
        default=sys.executable,
        help="the Python that runs the suites (default: the one running this script)",
    )
    args, rest = p.parse_known_args(argv)
    if rest and "bench" not in args.suites:
        p.error(
            f"unrecognized arguments: {' '.join(rest)} (only --suite bench takes extra arguments)"
        )
    if args.timeout <= 0:
        p.error("--timeout must be positive")
    return args, rest


def main(argv=None) -> int:
    args, rest = parse_args(argv)
    record = Runner(args, rest).execute()
    return EXIT_CODES[record["status"]]


if __name__ == "__main__":
    sys.exit(main())
