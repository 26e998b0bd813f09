"""Build script for ruda_torch's native extension `ruda_torch._C`.

The CPU kernels are always built. The CUDA kernels are built when the installed torch
has CUDA and a CUDA toolkit is found; no GPU is needed to build them. See
docs/building.md for the switches:

  RUDA_TORCH_CUDA=auto|1|0   build CUDA kernels when possible (auto, default), always
                             (1: fail if impossible) or never (0)
  CUDA_HOME                  the toolkit root (the folder with bin/nvcc and lib64/)
  TORCH_CUDA_ARCH_LIST       GPU architectures; default "9.0" when no GPU is visible
  RUDA_TORCH_CPU_ISA=auto|avx2|default
                             vector ISA of the CPU kernels (auto: AVX2+FMA+F16C when the
                             build machine has them)

Note [Finding the CUDA toolkit]: torch.utils.cpp_extension fixes CUDA_HOME when it is
imported, and guesses it from the `nvcc` on PATH. Where that `nvcc` is a small shell
wrapper (a script that execs the real compiler), the guess is the wrapper's folder and
the link fails with "cannot find -lcudart". So the toolkit root is resolved here, before
torch.utils.cpp_extension is imported: explicit variables first, then the real compiler
behind the `nvcc` on PATH (following symlinks and, for a wrapper script, the path it
execs), then the conventional install folders.
"""

import glob
import os
import platform
import re
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg):
    print(f"[ruda_torch build] {msg}", file=sys.stderr, flush=True)


def _is_toolkit_root(path):
    if not path:
        return False
    nvcc = os.path.join(path, "bin", "nvcc")
    if not os.path.isfile(nvcc):
        return False
    with open(nvcc, "rb") as f:
        if f.read(4) != b"\x7fELF":  # a wrapper script is not a toolkit root
            return False
    libs = glob.glob(os.path.join(path, "lib64", "libcudart*")) + glob.glob(
        os.path.join(path, "targets", "*", "lib", "libcudart*")
    )
    return bool(libs)


def _toolkit_from_nvcc_on_path():
    nvcc = shutil.which("nvcc")
    if not nvcc:
        return []
    real = os.path.realpath(nvcc)
    candidates = [os.path.dirname(os.path.dirname(real))]
    try:
        with open(real, "rb") as f:
            head = f.read(4096)
        if not head.startswith(b"\x7fELF"):
            for m in re.finditer(rb"(/[^\s\"']+)/bin/nvcc", head):
                candidates.append(m.group(1).decode())
    except OSError:
        pass
    return candidates


def find_cuda_home(torch_cuda_version):
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    candidates += _toolkit_from_nvcc_on_path()
    if torch_cuda_version:
        candidates.append(f"/usr/local/cuda-{torch_cuda_version}")
    candidates += ["/usr/local/cuda", "/opt/cuda"]
    for c in candidates:
        if c and _is_toolkit_root(os.path.realpath(c)):
            return os.path.realpath(c)
    return None


def cpu_has_avx2():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return all(re.search(rf"\b{x}\b", flags) for x in ("avx2", "fma", "f16c"))


# Note [No FMA contraction] (below); also read by tests/test_cuda_ptx.py, which compiles
# the update kernel to PTX with them.
NVCC_FLAGS = (
    "-O3",
    "--fmad=false",
    "-prec-div=true",
    "-prec-sqrt=true",
    "-ftz=false",
    "-DCPU_CAPABILITY=DEFAULT",
)


def main():
    import torch

    want_cuda = os.environ.get("RUDA_TORCH_CUDA", "auto").lower()
    if want_cuda not in ("auto", "0", "1"):
        sys.exit(f"RUDA_TORCH_CUDA must be auto, 0 or 1 (got {want_cuda!r})")
    cuda_home = None
    build_cuda = False
    if want_cuda != "0":
        if torch.version.cuda is None:
            reason = f"torch {torch.__version__} is a CPU-only build"
        else:
            cuda_home = find_cuda_home(torch.version.cuda)
            reason = None if cuda_home else "no CUDA toolkit found (set CUDA_HOME)"
        if reason is None:
            build_cuda = True
        elif want_cuda == "1":
            sys.exit(f"RUDA_TORCH_CUDA=1 but the CUDA kernels cannot be built: {reason}")
        else:
            _log(f"building CPU kernels only: {reason}")
    if build_cuda:
        os.environ["CUDA_HOME"] = cuda_home
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            # With no visible GPU torch cannot pick an architecture and cpp_extension fails
            # with an IndexError; Hopper (H100/H200) is the default target.
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        _log(
            f"building CPU and CUDA kernels (CUDA_HOME={cuda_home}, "
            f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '<from GPU>')})"
        )

    # Imported only now: it reads CUDA_HOME at import time (Note [Finding the CUDA toolkit]).
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    isa = os.environ.get("RUDA_TORCH_CPU_ISA", "auto").lower()
    if isa not in ("auto", "avx2", "default"):
        sys.exit(f"RUDA_TORCH_CPU_ISA must be auto, avx2 or default (got {isa!r})")
    use_avx2 = isa == "avx2" or (isa == "auto" and cpu_has_avx2())
    _log(f"CPU kernels: {'AVX2+FMA+F16C' if use_avx2 else 'portable (no AVX2)'}")

    # Note [No FMA contraction]: the shared math (csrc/adamw_math.h, csrc/grad_stats.h)
    # must round every multiply and add separately so that CPU and CUDA give the same
    # bits; -ffp-contract=off / --fmad=false forbid fusing a*b+c. No fast-math anywhere.
    # The C++ standard is chosen by torch.utils.cpp_extension (C++17 or C++20 by torch version).
    cxx = ["-O3", "-Wno-unknown-pragmas", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
    if use_avx2:
        cxx += ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    else:
        cxx += ["-DCPU_CAPABILITY=DEFAULT"]
    nvcc = list(NVCC_FLAGS)
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    kwargs = dict(
        name="ruda_torch._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_link_args=["-fopenmp"],
    )
    if build_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
        ext = CUDAExtension(
            sources=sources,
            define_macros=[("RUDA_TORCH_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            **kwargs,
        )
    else:
        ext = CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)

    setup(
        ext_modules=[ext],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":
    main()
