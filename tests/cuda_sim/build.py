"""Builds the emulated CUDA kernels (tests/cuda_sim) as the module ``ruda_torch_cuda_sim``
(Note [CUDA emulation] in csrc/cuda_sim/cuda_sim.h): the kernels of csrc/cuda compiled as
C++, the binding code that prepares their launches, and tests/cuda_sim/sim_module.cpp.
``RUDA_CUDA_SIM_SANITIZE=address`` builds it with AddressSanitizer (run with libasan
preloaded, as `make test-cuda-sim` does); The kernels are compiled from a copy of csrc/cuda in build/cuda_sim/src (kept in step
here); with ``RUDA_CUDA_SIM_SOURCE`` set, from that folder as it is (the mutation check
writes its mutants there). Needs neither a GPU nor a CUDA
toolkit."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


SOURCE = ROOT / "build" / "cuda_sim" / "src"


def sync_sources(folder: Path = SOURCE) -> None:
    """Copies csrc/cuda into ``folder``/cuda, rewriting only files whose text differs (an
    unchanged copy keeps its time, and ninja its object)."""
    target = folder / "cuda"
    target.mkdir(parents=True, exist_ok=True)
    for path in (ROOT / "csrc" / "cuda").iterdir():
        copy = target / path.name
        text = path.read_text()
        if not copy.exists() or copy.read_text() != text:
            copy.write_text(text)


def load(verbose: bool = False):
    from torch.utils.cpp_extension import load as _load

    sanitize = os.environ.get("RUDA_CUDA_SIM_SANITIZE", "")
    # The kernels are compiled from a copy in one fixed folder (SOURCE), which the
    # mutation check rewrites: every build of a sanitizer variant then shares one build
    # folder, and a mutant recompiles only the kernels, not the binding code.
    source = Path(os.environ.get("RUDA_CUDA_SIM_SOURCE", SOURCE))
    if "RUDA_CUDA_SIM_SOURCE" not in os.environ:
        sync_sources()
    flags = ["-O1", "-g", "-ffp-contract=off", "-fno-math-errno", "-Wno-unknown-pragmas",
             "-DRUDA_TORCH_WITH_CUDA=1", "-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT",
             "-fvisibility=hidden"]  # fmt: skip
    ldflags = []
    if sanitize:
        flags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"]
        ldflags += [f"-fsanitize={sanitize}"]
    digest = hashlib.sha1(str(source).encode()).hexdigest()[:10]
    build_dir = ROOT / "build" / "cuda_sim" / f"{sanitize or 'plain'}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    sources = [str(HERE / "kernels_sim.cpp")]
    # The binding code (csrc/bindings.cpp prepares launches on the host) and the module's
    # glue (sim_module.cpp) are not what the sanitizers are for, and are the slowest files
    # to compile (torch's headers): a sanitizer build links the plain build's objects when
    # there are any, and instruments the kernels and the emulated device alone (a
    # sanitizer reports what instrumented code does; uninstrumented objects only go
    # unchecked, as the rest of torch does).
    # They include nothing from `source`, so a mutant's build (another source folder)
    # links them too.
    shared = source != SOURCE or sanitize
    plain = (
        ROOT / "build" / "cuda_sim" / f"plain-{hashlib.sha1(str(SOURCE).encode()).hexdigest()[:10]}"
    )
    for name, src in (("sim_module.o", HERE / "sim_module.cpp"),
                      ("bindings.o", ROOT / "csrc" / "bindings.cpp")):  # fmt: skip
        if shared and (plain / name).exists():
            ldflags.append(str(plain / name))
        else:
            sources.append(str(src))
    return _load(
        name="ruda_torch_cuda_sim",
        sources=sources,
        # csrc/cuda_sim first: its cuda_runtime.h, cuda_fp16.h and cuda_bf16.h are the device.
        extra_include_paths=[str(ROOT / "csrc" / "cuda_sim"), str(source), str(ROOT / "csrc")],
        extra_cflags=flags,
        extra_ldflags=ldflags,
        build_directory=str(build_dir),
        verbose=verbose,
    )
