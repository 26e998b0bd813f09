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


# Template arguments of adamw_kernel<P, G, S, AMSGRAD> in the mangled name: the parameter,
# gradient and moment dtypes (Note [Parameter dtypes], Note [Low-precision states] in
# csrc/adamw_math.h). A repeated class type is a substitution: S2_ names the first one
# (after the two namespaces), S3_ the second.
_TYPES = {"f": "fp32", "d": "fp64", "6__half": "fp16", "13__nv_bfloat16": "bf16"}
_ARG = r"(f|d|6__half|13__nv_bfloat16|S\d_)"
_KERNEL = re.compile(rf"adamw_kernelI{_ARG}{_ARG}{_ARG}Lb([01])ELb([01])E")
PAIRS = {("fp32", "fp32"), ("fp32", "fp16"), ("fp32", "bf16"), ("fp16", "fp16"), ("fp16", "fp32"),
         ("bf16", "bf16"), ("bf16", "fp32"), ("fp64", "fp64")}  # fmt: skip


def _template_types(m: re.Match) -> list[str]:
    classes, out = [], []
    for arg in m.groups()[:3]:
        if arg.startswith("S"):
            out.append(classes[int(arg[1]) - 2])
        else:
            out.append(_TYPES[arg])
            if arg[0].isdigit():
                classes.append(_TYPES[arg])
    return out


def test_aligned_path_uses_wide_loads_and_stores(ptx):
    """FP32 state and FP32 parameters, masters and gradients move 16 bytes per access,
    16-bit parameters, BF16 moments and int16 remainders (the REM kernels, Note [Remainder
    master]) 8 bytes (4 elements); FP64 buckets use scalar accesses."""
    kernels = _kernels(ptx)
    found = {}
    for name, body in kernels.items():
        m = _KERNEL.search(name)
        assert m, f"unexpected kernel {name}"
        param, grad, state = _template_types(m)
        amsgrad, rem = m.group(4) == "1", m.group(5) == "1"
        found[(param, grad, state, amsgrad, rem)] = name
        if param == "fp64":
            continue
        stores = re.findall(r"st\.global(?:\.\w+)*\.v4\.f32", body)
        loads = re.findall(r"ld\.global(?:\.\w+)*\.v4\.f32", body)
        moments = 3 if amsgrad else 2  # exp_avg, exp_avg_sq (+ max_exp_avg_sq)
        wide = moments if state == "fp32" else 0
        # + the parameter (FP32) or the master (16-bit parameters with master weights; a
        # remainder kernel has none)
        need = wide + (not rem)
        assert len(stores) >= need, f"{name}: {len(stores)} 16-byte stores, want {need}"
        need += grad == "fp32"
        assert len(loads) >= need, f"{name}: {len(loads)} 16-byte FP32 loads, want {need}"
        narrow = (moments if state == "bf16" else 0) + (param in ("fp16", "bf16")) + rem
        if narrow:  # four 16-bit elements as one uint2 (load_bits16, store_bits16)
            for op in ("ld", "st"):
                found_ = re.findall(rf"{op}\.global(?:\.\w+)*\.v2\.u32", body)
                assert len(found_) >= narrow, f"{name}: {len(found_)} 8-byte {op}, want {narrow}"
    states = {"fp64": ("fp64",)}
    want = {(p, g, st, a, r) for p, g in PAIRS for st in states.get(p, ("fp32", "bf16"))
            for a in (False, True) for r in ((False, True) if p == "bf16" else (False,))}  # fmt: skip
    assert set(found) == want, f"kernel variants: {sorted(found)}"
