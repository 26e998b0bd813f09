"""tools/gpu_check.sh, the one script a lent GPU machine runs, on a machine without one:
it must stop at once with exit status 2 and a complete log, and its preflight must name
what is missing before any build starts (a GPU run is too short to lose to a missing
package). The GPU is faked for the preflight case by a sitecustomize module that makes
torch report one device-less CUDA runtime."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gpu_check.sh")

FAKE_SITE = """
import importlib.util
import os

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 0
_find_spec = importlib.util.find_spec
_hidden = set(os.environ.get("RUDA_TEST_HIDE_MODULES", "").split(","))
importlib.util.find_spec = lambda name, *a, **k: None if name in _hidden else _find_spec(name, *a, **k)
"""


def _run(tmp_path, extra_env=None):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(OUT=str(tmp_path / "out"), PYTHON=sys.executable, DEADLINE="60")
    env.update(extra_env or {})
    done = subprocess.run(
        ["bash", SCRIPT], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path
    )
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    return done, log


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_it_stops_with_status_2_and_a_complete_log(tmp_path):
    done, log = _run(tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "STOP: no GPU is visible" in done.stdout
    assert log == done.stdout, "the log lost what the script printed last"


def test_preflight_names_what_is_missing_before_building(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAKE_SITE)
    done, log = _run(
        tmp_path,
        {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}", "RUDA_TEST_HIDE_MODULES": "numpy,pytest"},
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "STOP: missing the Python module numpy (pip install numpy)" in log
    assert "the Python module pytest" in log
    assert "==== build" not in log, "the preflight must stop the run before the build"
    assert log == done.stdout
