"""Facts about the compiled extension: which backends exist, and the error for the rest;
and the choice of the CPU kernels' ISA build (Note [CPU ISA at run time] in
csrc/cpu/dispatch.cpp)."""

import importlib
import os
import warnings

import torch

try:  # written by setup.py with the extension
    from ._build_info import TORCH_VERSION as _BUILD_INFO_TORCH
except ImportError:
    _BUILD_INFO_TORCH = None


# Note [Built against one torch]
# The extension is compiled against torch's C++ headers and library, whose ABI changes
# between minor releases: an extension built against one and loaded under another may
# fail to load, or load and misbehave. pip's isolated builds used to do exactly that
# (compile against the newest torch in a throwaway environment, then install into the
# user's); setup.py now refuses to build without the user's torch, and the import refuses
# an extension whose torch differs in major.minor from the running one.
def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def _check_torch(built_with: str | None) -> None:
    if built_with is not None and _release(built_with) != _release(torch.__version__):
        raise ImportError(
            f"ruda_torch's extension was built against torch {built_with}, but torch "
            f"{torch.__version__} is running: rebuild it against this torch with "
            "`pip install --no-build-isolation --force-reinstall --no-deps .` "
            "(docs/building.md)"
        )


_check_torch(_BUILD_INFO_TORCH)  # before loading it: under another torch it may not load

from . import _C  # noqa: E402  (importing runs the operator registrations)

BUILT_WITH_TORCH: str | None = getattr(_C, "torch_version", _BUILD_INFO_TORCH)
_check_torch(BUILT_WITH_TORCH)

CUDA_COMPILED: bool = bool(_C.cuda_compiled)
CPU_ISA_ORDER = ("default", "avx2", "avx512")
# ISA_ENV, else torch's own variable, names the CPU kernels' ISA (lower: for a check).
ISA_ENV = "RUDA_TORCH_CPU_CAPABILITY"


def _built_isas() -> tuple[str, ...]:
    built = []
    for isa in CPU_ISA_ORDER:
        try:
            importlib.import_module(f"{__package__}._cpu_{isa}")
        except ImportError:
            continue
        built.append(isa)
    return tuple(built)


def choose_cpu_isa(requested: str | None, built, supported) -> tuple[str, str | None]:
    """(the ISA build to use, a warning or None): the best build this CPU runs, no better
    than ``requested`` (a name of CPU_ISA_ORDER, any case; None: no limit)."""
    if requested is not None:
        want = requested.strip().lower()
        if want not in CPU_ISA_ORDER:
            raise ValueError(
                f"{ISA_ENV} (or ATEN_CPU_CAPABILITY) must be one of "
                f"{', '.join(CPU_ISA_ORDER)}, got {requested!r}"
            )
    else:
        want = CPU_ISA_ORDER[-1]
    limit = CPU_ISA_ORDER.index(want)
    usable = [i for i in CPU_ISA_ORDER[: limit + 1] if i in built and i in supported]
    if not usable:
        raise ImportError(
            "ruda_torch: no build of the CPU kernels can run here (built: "
            f"{', '.join(built) or 'none'}; this CPU runs: {', '.join(supported)}); rebuild "
            "the package (docs/building.md)"
        )
    chosen = usable[-1]
    note = None
    if requested is not None and chosen != want:
        why = "this CPU does not run it" if want not in supported else "it was not built"
        note = (
            f"ruda_torch: {ISA_ENV}={requested} asked for {want} kernels, but {why}; using {chosen}"
        )
    return chosen, note


def use_cpu_isa(isa: str) -> str:
    """Install the CPU kernels of build ``isa`` (tests compare the builds' bits)."""
    module = importlib.import_module(f"{__package__}._cpu_{isa}")
    return _C.set_cpu_kernels(module.kernels)


CPU_ISAS_BUILT: tuple[str, ...] = _built_isas()
CPU_ISAS_SUPPORTED: tuple[str, ...] = tuple(_C.cpu_supports())
_requested = os.environ.get(ISA_ENV) or os.environ.get("ATEN_CPU_CAPABILITY") or None
CPU_ISA, _note = choose_cpu_isa(_requested, CPU_ISAS_BUILT, CPU_ISAS_SUPPORTED)
if _note:
    warnings.warn(_note, stacklevel=2)
use_cpu_isa(CPU_ISA)
STATS_CHUNK: int = _C.stats_chunk
MERGE_FAN_IN: int = _C.merge_fan_in
BLOCK_8BIT: int = _C.block_8bit  # elements per block of 8-bit codes (kBlock8, csrc/quant8.h)
BLOCK_4BIT: int = _C.block_4bit  # elements per block of 4-bit codes (kBlock4, csrc/quant4.h)

BUILD_HINT = (
    "Rebuild with a CUDA build of torch and a CUDA toolkit: "
    "`RUDA_TORCH_CUDA=1 pip install --no-build-isolation -e .` "
    "(set CUDA_HOME to the toolkit root if it is not found; see docs/building.md)."
)


def cpu_capability() -> str:
    """The vector ISA of the CPU kernels in use: "default", "avx2" or "avx512"."""
    return CPU_ISA


def compiled_backends() -> tuple[str, ...]:
    """The backends whose kernels this build contains, e.g. ``("cpu", "cuda")``."""
    return ("cpu", "cuda") if CUDA_COMPILED else ("cpu",)


def check_device(device, what: str) -> None:
    """Raise a clear error when no kernel of this build can run on ``device``."""
    if device.type == "cpu" or (device.type == "cuda" and CUDA_COMPILED):
        return
    if device.type == "cuda":
        raise RuntimeError(
            f"{what} got CUDA tensors, but this ruda_torch build has no CUDA kernels "
            f"(compiled backends: {', '.join(compiled_backends())}). {BUILD_HINT}"
        )
    raise RuntimeError(
        f"{what} got tensors on {device}, which ruda_torch has no kernels for "
        f"(compiled backends: {', '.join(compiled_backends())})."
    )
