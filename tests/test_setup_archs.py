"""setup.py refuses GPU targets the CUDA kernels cannot be built for (compute capability below
8.0: they use cvt.rz.f16x2.f32, cvt.rn.bf16x2.f32, redux.sync and max.NaN.f32), naming the
setting and what to do, before compiling anything."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_module():
    spec = importlib.util.spec_from_file_location(
        "ruda_torch_setup", os.path.join(ROOT, "setup.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "value,old",
    [("9.0", []), ("8.0;9.0", []), ("8.6+PTX 9.0a", []), ("Ampere;Hopper", []),
     ("7.5", ["7.5"]), ("7.0;8.0", ["7.0"]), ("6.1 7.5+PTX 9.0", ["6.1", "7.5+PTX"]),
     ("Turing;Hopper", ["Turing"]), (" 8.9 ; ", [])],
)  # fmt: skip
def test_too_old_archs(value, old):
    assert _setup_module().too_old_archs(value) == old


def test_build_for_an_old_target_is_refused_before_compiling():
    setup = _setup_module()
    if torch.version.cuda is None or setup.find_cuda_home(torch.version.cuda) is None:
        pytest.skip("needs a CUDA torch and a CUDA toolkit (the CUDA build path)")
    env = dict(os.environ, TORCH_CUDA_ARCH_LIST="7.5;9.0", RUDA_TORCH_CUDA="1")
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0
    assert "TORCH_CUDA_ARCH_LIST='7.5;9.0' asks for compute capability 7.5" in r.stderr
    assert "RUDA_TORCH_CUDA=0" in r.stderr
