"""Build script for ruda_torch's native extension `ruda_torch._C`.

The CPU kernels are always built. The CUDA kernels are built when the installed torch
has CUDA and a CUDA toolkit is found; no GPU is needed to build them. See
docs/building.md for the switches:

  RUDA_TORCH_CUDA=auto|1|0   build CUDA kernels when possible (auto, default), always
                             (1: fail if impossible) or never (0)
  CUDA_HOME                  the toolkit root (the folder with bin/nvcc and lib64/)
  TORCH_CUDA_ARCH_LIST       GPU architectures; default "9.0" when no GPU is visible
  RUDA_TORCH_CPU_ISA=all|<comma list of default, avx2, avx512>
                             the vector ISAs the CPU kernels are compiled for (all, the
                             default: every one the platform and compiler have; x86-64
                             only beyond default); the best one the running CPU supports
                             is chosen at import (Note [CPU ISA at run time])

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


# The vector ISAs of the CPU kernels: the compiler flags of each build, torch's
# CPU_CAPABILITY macros (which select at::vec's implementation and namespace it).
CPU_ISA_FLAGS = {
    "default": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "avx512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],  # fmt: skip
}


def cpu_isas():
    """The ISA builds asked for by RUDA_TORCH_CPU_ISA (all those this platform has)."""
    want = os.environ.get("RUDA_TORCH_CPU_ISA", "all").lower().replace(" ", "")
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    possible = list(CPU_ISA_FLAGS) if x86 else ["default"]
    if want in ("all", "auto"):
        return possible
    isas = want.split(",")
    unknown = [i for i in isas if i not in CPU_ISA_FLAGS]
    if unknown or not isas:
        sys.exit(
            f"RUDA_TORCH_CPU_ISA must be all or a comma list of {', '.join(CPU_ISA_FLAGS)} "
            f"(got {want!r})"
        )
    if "default" not in isas:
        sys.exit("RUDA_TORCH_CPU_ISA must include default: it is what every CPU runs")
    missing = [i for i in isas if i not in possible]
    if missing:
        sys.exit(f"RUDA_TORCH_CPU_ISA: {', '.join(missing)} is x86-64 only")
    return [i for i in CPU_ISA_FLAGS if i in isas]


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


def isa_sources(isa):
    """The wrapper sources of one ISA build, written only when they change (which keeps
    incremental builds incremental)."""
    out = []
    folder = os.path.join("build", "cpu_isa", isa)
    os.makedirs(folder, exist_ok=True)
    for src in sorted(glob.glob("csrc/cpu/kernels/*.cpp")):
        name = os.path.basename(src)
        text = (
            f'// generated by setup.py: the {isa} build of {src}\n#include "cpu/kernels/{name}"\n'
        )
        path = os.path.join(folder, name)
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
        out.append(path)
    return out


# setup.py commands that compile the extension (directly or through a wheel); the others
# (sdist, egg_info, dist_info, clean, ...) only describe or package the sources and run
# without torch, so that `python -m build --sdist` works in an isolated environment.
BUILD_COMMANDS = {"build", "build_ext", "bdist_wheel", "bdist_egg", "install", "develop",
                  "editable_wheel"}  # fmt: skip

NO_TORCH = """ruda_torch: no torch is importable in this build environment.

ruda_torch compiles its extension against the torch that will run it (a build against
another torch version is no guaranteed ABI, and would refuse to import). pip builds in an
isolated environment by default, which has no torch. Install torch first, then build in
your environment:

    pip install --no-build-isolation .          (or the sdist: pip install
                                                 --no-build-isolation ruda_torch-*.tar.gz)

A CPU-only torch builds the CPU kernels only (docs/building.md)."""


# The CUDA kernels use instructions of compute capability 8.0 and later (cvt.rz.f16x2.f32 and
# cvt.rn.bf16x2.f32, redux.sync, max.NaN.f32): an older target fails in ptxas with a message
# that names an instruction, not the setting; this names the setting. torch's named targets
# as it expands them (torch.utils.cpp_extension).
_OLD_ARCH_NAMES = ("kepler", "maxwell", "pascal", "volta", "turing")


def too_old_archs(arch_list):
    """The entries of a TORCH_CUDA_ARCH_LIST value below compute capability 8.0."""
    out = []
    for entry in re.split(r"[;\s]+", arch_list.strip()):
        if not entry:
            continue
        m = re.match(r"(\d+)\.(\d+)", entry)
        if m:
            if (int(m.group(1)), int(m.group(2))) < (8, 0):
                out.append(entry)
        elif entry.lower().startswith(_OLD_ARCH_NAMES):
            out.append(entry)
    return out


def main():
    try:
        import torch
    except ImportError:
        if not BUILD_COMMANDS.intersection(sys.argv[1:]):
            setup()  # metadata or sdist: the sources only (MANIFEST.in)
            return
        sys.exit(NO_TORCH)

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
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if archs:
            old = too_old_archs(archs)
            where = f"TORCH_CUDA_ARCH_LIST={archs!r} asks for"
        else:  # torch builds for the visible GPUs
            n = torch.cuda.device_count()
            caps = sorted({torch.cuda.get_device_capability(i) for i in range(n)})
            old = [f"{a}.{b}" for a, b in caps if (a, b) < (8, 0)]
            where = "a visible GPU is"
        if old:
            sys.exit(
                f"{where} compute capability {', '.join(old)}: the CUDA kernels need 8.0 or "
                'later (Ampere, Ada, Hopper). Set TORCH_CUDA_ARCH_LIST to those (e.g. "8.0;9.0"), '
                "or RUDA_TORCH_CUDA=0 to build the CPU kernels only."
            )
        _log(
            f"building CPU and CUDA kernels (CUDA_HOME={cuda_home}, "
            f"TORCH_CUDA_ARCH_LIST={os.environ.get('TORCH_CUDA_ARCH_LIST', '<from GPU>')})"
        )

    # Imported only now: it reads CUDA_HOME at import time (Note [Finding the CUDA toolkit]).
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    isas = cpu_isas()
    _log(f"CPU kernels for: {', '.join(isas)} (chosen at import)")

    # Note [No FMA contraction]: the shared math (csrc/adamw_math.h, csrc/grad_stats.h)
    # must round every multiply and add separately so that CPU and CUDA give the same
    # bits; -ffp-contract=off / --fmad=false forbid fusing a*b+c. No fast-math anywhere.
    # The C++ standard is chosen by torch.utils.cpp_extension (C++17 or C++20 by torch version).
    base = ["-O3", "-Wno-unknown-pragmas", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
    cxx = base + CPU_ISA_FLAGS["default"]  # `_C` itself is portable
    nvcc = list(NVCC_FLAGS)
    sources = sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    kwargs = dict(
        name="ruda_torch._C",
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_link_args=["-fopenmp"],
    )
    # The torch this extension is compiled against: ruda_torch/_build.py refuses to import
    # it under another one (Note [Built against one torch]), reading it from a Python file
    # before loading the extension (which may not even load under another torch) and
    # from the extension itself.
    torch_macro = [("RUDA_TORCH_BUILT_WITH", f'"{torch.__version__}"')]
    info = os.path.join(ROOT, "ruda_torch", "_build_info.py")
    text = f'"""Written by setup.py."""\n\nTORCH_VERSION = "{torch.__version__}"\n'
    if not os.path.exists(info) or open(info).read() != text:
        with open(info, "w") as f:
            f.write(text)
    if build_cuda:
        sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
        ext = CUDAExtension(
            sources=sources,
            define_macros=[("RUDA_TORCH_WITH_CUDA", "1"), *torch_macro],
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            **kwargs,
        )
    else:
        ext = CppExtension(
            sources=sources, define_macros=torch_macro, extra_compile_args={"cxx": cxx}, **kwargs
        )
    # One module per ISA build of the CPU kernels, with hidden symbols (Note [CPU ISA at
    # run time] in csrc/cpu/dispatch.cpp). Each build compiles wrapper sources of its own
    # (build/cpu_isa/<isa>/*.cpp, each including one file of csrc/cpu/kernels/), so that
    # the builds' object files do not share a path in the build folder.
    isa_exts = [
        CppExtension(
            name=f"ruda_torch._cpu_{isa}",
            sources=isa_sources(isa),
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={
                "cxx": base
                + CPU_ISA_FLAGS[isa]
                + [
                    "-fvisibility=hidden",
                    "-fvisibility-inlines-hidden",
                    f"-DRUDA_ISA_NAME={isa}",
                    f"-DRUDA_ISA_INIT=PyInit__cpu_{isa}",
                ]  # fmt: skip
            },
            extra_link_args=["-fopenmp"],
        )
        for isa in isas
    ]

    setup(
        ext_modules=[ext, *isa_exts],
        cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    )


if __name__ == "__main__":
    main()
