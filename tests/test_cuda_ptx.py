"""The update kernel's aligned path uses 16-byte loads and stores (issue: the stores were
four 32-bit ones). Compiles csrc/cuda/adamw_cuda.cu to PTX for sm_90 with setup.py's
nvcc flags and reads the instructions of every adamw_kernel variant. Needs the CUDA
toolkit that the build used (it is there whenever this build has CUDA kernels); runs on
a machine without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess

import pytest
import torch
from torch.utils import cpp_extension

import ruda_torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    "cuda" not in ruda_torch.compiled_backends(),
    reason="this build has no CUDA kernels (and so no toolkit to compile them with)",
)


def _setup_module():
    spec = importlib.util.spec_from_file_location(
        "ruda_torch_setup", os.path.join(ROOT, "setup.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # main() runs only as a script
    return module


@pytest.fixture(scope="module")
def ptx(tmp_path_factory) -> str:
    setup = _setup_module()
    home = setup.find_cuda_home(torch.version.cuda)
    assert home, "the CUDA build found a toolkit, this test must find it too (set CUDA_HOME)"
    out = tmp_path_factory.mktemp("ptx") / "adamw_cuda.ptx"
    includes = [os.path.join(ROOT, "csrc"), os.path.join(home, "include")]
    includes += cpp_extension.include_paths()
    cmd = [
        os.path.join(home, "bin", "nvcc"),
        "-ptx",
        "-arch=compute_90",
        "-std=c++20",  # what torch.utils.cpp_extension passes for this torch
        "-DRUDA_TORCH_WITH_CUDA=1",
        *setup.NVCC_FLAGS,
        *cpp_extension.COMMON_NVCC_FLAGS,
        *(f"-I{d}" for d in includes),
        os.path.join(ROOT, "csrc", "cuda", "adamw_cuda.cu"),
        "-o",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    return out.read_text()


def _kernels(ptx: str) -> dict[str, str]:
    """Body of every .entry whose name contains adamw_kernel, by mangled name."""
    bodies = {}
    for m in re.finditer(r"\.entry\s+(\S*adamw_kernel\S*)\s*\(", ptx):
        start = ptx.index("{", m.end())
        depth, i = 0, start
        while True:
            depth += {"{": 1, "}": -1}.get(ptx[i], 0)
            i += 1
            if depth == 0:
                break
        bodies[m.group(1)] = ptx[start:i]
    return bodies


def test_aligned_path_uses_16_byte_loads_and_stores(ptx):
    kernels = _kernels(ptx)
    assert len(kernels) == 6, f"expected 3 gradient dtypes x AMSGrad on/off, got {list(kernels)}"
    for name, body in kernels.items():
        amsgrad = "Lb1E" in name  # template argument AMSGRAD = true
        stores = re.findall(r"st\.global(?:\.\w+)*\.v4\.f32", body)
        loads = re.findall(r"ld\.global(?:\.\w+)*\.v4\.f32", body)
        need = 4 if amsgrad else 3  # parameter, exp_avg, exp_avg_sq (+ max_exp_avg_sq)
        assert len(stores) >= need, f"{name}: {len(stores)} 16-byte stores, want {need}"
        need += "adamw_kernelIf" in name  # FP32 gradients are loaded 16 bytes at a time too
        assert len(loads) >= need, f"{name}: {len(loads)} 16-byte FP32 loads, want {need}"
