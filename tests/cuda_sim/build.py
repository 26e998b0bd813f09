"""Builds the emulated CUDA kernels (tests/cuda_sim) as the module ``ruda_torch_cuda_sim``
(Note [CUDA emulation] in csrc/cuda_sim/cuda_sim.h): the kernels of csrc/cuda compiled as
C++, the binding code that prepares their launches, and tests/cuda_sim/sim_module.cpp.
``RUDA_CUDA_SIM_SANITIZE=address`` builds it with AddressSanitizer (run with libasan
preloaded, as `make test-cuda-sim` does); ``RUDA_CUDA_SIM_SOURCE`` replaces the folder of
the .cu files (the mutation check builds mutated copies). Needs neither a GPU nor a CUDA
toolkit."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


def load(verbose: bool = False):
    from torch.utils.cpp_extension import load as _load

    sanitize = os.environ.get("RUDA_CUDA_SIM_SANITIZE", "")
    source = Path(os.environ.get("RUDA_CUDA_SIM_SOURCE", ROOT / "csrc"))
    flags = ["-O1", "-g", "-ffp-contract=off", "-fno-math-errno", "-Wno-unknown-pragmas",
             "-DRUDA_TORCH_WITH_CUDA=1", "-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT",
             "-fvisibility=hidden"]  # fmt: skip
    ldflags = []
    if sanitize:
        flags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"]
        ldflags += [f"-fsanitize={sanitize}"]
    tag = f"{sanitize or 'plain'}-{hashlib.sha1(str(source).encode()).hexdigest()[:10]}"
    build_dir = ROOT / "build" / "cuda_sim" / tag
    build_dir.mkdir(parents=True, exist_ok=True)
    return _load(
        name="ruda_torch_cuda_sim",
        sources=[
            str(HERE / "sim_module.cpp"),
            str(HERE / "kernels_sim.cpp"),
            str(ROOT / "csrc" / "bindings.cpp"),
        ],  # fmt: skip
        # csrc/cuda_sim first: its cuda_runtime.h, cuda_fp16.h and cuda_bf16.h are the device.
        extra_include_paths=[str(ROOT / "csrc" / "cuda_sim"), str(source), str(ROOT / "csrc")],
        extra_cflags=flags,
        extra_ldflags=ldflags,
        build_directory=str(build_dir),
        verbose=verbose,
    )
