"""Facts about the compiled extension: which backends exist, and the error for the rest."""

from . import _C  # noqa: F401  (importing runs the operator registrations)

CUDA_COMPILED: bool = bool(_C.cuda_compiled)
CPU_ISA: str = _C.cpu_isa
STATS_CHUNK: int = _C.stats_chunk
MERGE_FAN_IN: int = _C.merge_fan_in

BUILD_HINT = (
    "Rebuild with a CUDA build of torch and a CUDA toolkit: "
    "`RUDA_TORCH_CUDA=1 pip install --no-build-isolation -e .` "
    "(set CUDA_HOME to the toolkit root if it is not found; see docs/building.md)."
)


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
