"""The commands in README.md and docs/*.md stay true to the code.

Every command line in a code block (indented or fenced) that starts with a Makefile
target, ``.venv/bin/python <script>``, ``.venv/bin/torchrun ... <script>`` or
``.venv/bin/python -m pytest`` is checked: the make target exists in the Makefile, the
script exists, and every ``--option`` the line passes is one the script's ``--help``
lists. The commands cheap enough to run here are run as written (``RUNNABLE``); the
others (full benchmarks, GPU runs, multi-process training) would take minutes or need
hardware, and are covered by their own tests or by the option check alone.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VENV_PY = ".venv/bin/python"


def _code_lines(text: str):
    """(line number, command) of every line in an indented or fenced code block,
    joined across trailing backslashes, comments stripped."""
    lines = text.splitlines()
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
            i += 1
            continue
        if fenced or line.startswith("    "):
            start = i
            cmd = line.strip()
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + " " + lines[i].strip()
            yield start + 1, cmd.split("  #")[0].split(" # ")[0].strip()
        i += 1


def _commands():
    out = []
    for doc in DOCS:
        for lineno, cmd in _code_lines(doc.read_text()):
            if re.match(r"^(make \w|\.venv/bin/(python|torchrun) )", cmd):
                out.append(pytest.param(cmd, id=f"{doc.name}:{lineno}"))
    return out


@cache
def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+):", text, re.M))


@cache
def _help(script: str) -> str:
    run = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)  # fmt: skip
    assert run.returncode == 0, f"{script} --help failed: {run.stderr[-2000:]}"
    return run.stdout


def test_the_docs_have_commands():
    assert len(_commands()) >= 15


@pytest.mark.parametrize("cmd", _commands())
def test_documented_command_names_what_exists(cmd):
    words = shlex.split(cmd)
    if words[0] == "make":
        for target in (w for w in words[1:] if "=" not in w):
            assert target in _make_targets(), f"`{cmd}`: no make target {target!r}"
        return
    args = words[1:]
    if args[:2] == ["-m", "pytest"]:
        for path in (a for a in args[2:] if a.startswith("tests/")):
            assert (ROOT / path.split("::")[0]).exists(), f"`{cmd}`: {path} does not exist"
        return
    at = next(i for i, a in enumerate(args) if a.endswith(".py"))
    script = args[at]
    assert (ROOT / script).exists(), f"`{cmd}`: {script} does not exist"
    usage = _help(script)
    if script == "tools/run_adamw_regressions.py" and "bench" in args:
        usage += _help("benchmarks/bench_adamw.py")  # it passes other arguments on
    for opt in (a.split("=")[0] for a in args[at + 1 :] if a.startswith("--")):  # torchrun's own
        assert re.search(rf"{re.escape(opt)}\b", usage), f"`{cmd}`: {script} has no {opt}"


# Commands run exactly as documented (seconds each), by document and line text.
RUNNABLE = [
    ".venv/bin/python examples/bf16_training.py --steps 400 --plot docs/images/bf16_loss_gap.png",
]


@pytest.mark.parametrize("cmd", RUNNABLE)
def test_runnable_commands_run_as_written(cmd, tmp_path):
    documented = {c.values[0] for c in _commands()}
    assert cmd in documented, f"`{cmd}` is no longer in the docs"
    words = shlex.split(cmd)
    words[0] = sys.executable  # the same interpreter (.venv's under make test)
    # Outputs go to a temporary folder: the docs' own files are not rewritten by a test.
    words = [str(tmp_path / Path(w).name) if w.startswith("docs/images/") else w for w in words]
    run = subprocess.run(words, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
