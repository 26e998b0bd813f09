"""The CUDA kernels' static check (`make check-cuda-static`, run by CI): every kernel of
csrc/cuda compiled for sm_90 (Hopper) and sm_80 (Ampere) with the build's nvcc flags, and
held to three rules that decide how fast it can run, without a GPU:

* no register spill (ptxas -v: "0 bytes spill stores, 0 bytes spill loads");
* theoretical occupancy of at least 50% at the block size of its __launch_bounds__ (every
  kernel declares one, and its launch uses that block size): 65,536 registers, 64 warps and
  32 blocks per SM on both, registers allocated 256 per warp within the SM's 4 partitions,
  shared memory 228 KiB (sm_90) or 164 KiB (sm_80) per SM, 1 KiB of it per block reserved;
* no 32-bit global load inside a loop where a wider one is possible: every LDG of 32 bits in
  a loop of the disassembly comes from a source line (or a function inlined there) that says
  why with "static-check: 32-bit" (a step counter, a block's scale, a view that is not
  aligned, the statistics' canonical lane order, ...). A new 32-bit load in a loop fails
  until someone writes down why it must be one.

Needs nvcc (the CUDA toolkit the build uses), torch (for its headers) and nvdisasm, which
pip installs (the nvidia-cuda-nvdisasm package, in requirements-dev.txt; docs/building.md).
Usage: python tools/check_cuda_static.py [--arch 90 80] [--keep DIR] [-v]
"""

from __future__ import annotations

import argparse
import ast
import glob
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "static-check: 32-bit"

# Per SM: registers, warps, blocks, shared memory (bytes), shared memory reserved per block.
SM = {
    90: (65536, 64, 32, 233472, 1024),
    80: (65536, 64, 32, 167936, 1024),
}


def nvcc_flags() -> list[str]:
    """setup.py's NVCC_FLAGS, torch's common flags, C++ standard and include paths."""
    from torch.utils import cpp_extension as ce

    tree = ast.parse((ROOT / "setup.py").read_text())
    flags = None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "NVCC_FLAGS"
                                                for t in node.targets):  # fmt: skip
            flags = list(ast.literal_eval(node.value))
    if flags is None:
        sys.exit("check_cuda_static: setup.py has no NVCC_FLAGS")
    src = Path(ce.__file__).read_text()
    std = max(re.findall(r"-std=c\+\+(\d\d)", src) or ["17"], key=int)
    return (flags + list(ce.COMMON_NVCC_FLAGS) + [f"-std=c++{std}", "-DRUDA_TORCH_WITH_CUDA=1",
            f"-I{ROOT / 'csrc'}"] + [f"-I{d}" for d in ce.include_paths()])  # fmt: skip


def find_nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    import site

    for base in site.getsitepackages() + [site.getusersitepackages()]:
        for hit in glob.glob(os.path.join(base, "nvidia", "*", "bin", "nvdisasm")):
            return hit
    sys.exit("check_cuda_static: nvdisasm not found: pip install nvidia-cuda-nvdisasm "
             "(requirements-dev.txt; docs/building.md)")  # fmt: skip


def compile_one(cu: Path, arch: int, flags: list[str], out: Path) -> tuple[Path, str]:
    cubin = out / f"{cu.stem}.sm_{arch}.cubin"
    cmd = ["nvcc", "-cubin", f"-gencode=arch=compute_{arch},code=sm_{arch}", *flags,
           "-lineinfo", "-Xptxas", "-v", "-o", str(cubin), str(cu)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"check_cuda_static: nvcc failed on {cu.name} for sm_{arch}:\n{r.stderr[-3000:]}")
    return cubin, r.stdout + r.stderr


def parse_ptxas(log: str) -> dict[str, dict]:
    """{mangled kernel: {regs, spill_st, spill_ld, smem}}."""
    out, cur, spill = {}, None, (0, 0)
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            cur, spill = m.group(1), (0, 0)
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and cur:
            spill = (int(m.group(1)), int(m.group(2)))
            continue
        m = re.search(r"Used (\d+) registers(.*)", line)
        if m and cur:
            sm = re.search(r"(\d+) bytes smem", m.group(2))
            out[cur] = {"regs": int(m.group(1)), "spill_st": spill[0], "spill_ld": spill[1],
                        "smem": int(sm.group(1)) if sm else 0}  # fmt: skip
            cur = None
    return out


def demangle(names: list[str]) -> dict[str, str]:
    r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    outs = r.stdout.splitlines()
    return dict(zip(names, outs, strict=True)) if len(outs) == len(names) else {n: n for n in names}


def kernel_name(demangled: str) -> str:
    m = re.search(r"(\w+_kernel)", demangled)
    return m.group(1) if m else demangled


def constants() -> dict[str, int]:
    """The integer constants of csrc (constexpr int NAME = expression;), evaluated in order."""
    values: dict[str, int] = {}
    pat = re.compile(r"constexpr\s+(?:int|int32_t|int64_t)\s+(\w+)\s*=\s*([^;]+);")
    texts = [p.read_text() for p in sorted((ROOT / "csrc").rglob("*")) if p.suffix in
             (".h", ".cuh", ".cu", ".cpp")]  # fmt: skip
    for _ in range(3):  # constants defined from others, in any file order
        for text in texts:
            for name, expr in pat.findall(text):
                v = evaluate(expr, values)
                if v is not None:
                    values[name] = v
    return values


def evaluate(expr: str, values: dict[str, int]):
    expr = re.sub(r"static_cast<\w+>\(([^()]*)\)", r"\1", expr).strip()
    expr = re.sub(r"int64_t\((\w+)\)", r"\1", expr)
    if not re.fullmatch(r"[\w\s+\-*/()<]+", expr):
        return None
    names = set(re.findall(r"[A-Za-z_]\w*", expr))
    if not names <= set(values):
        return None
    py = re.sub(r"/", "//", expr)
    try:
        return int(eval(py, {"__builtins__": {}}, values))  # noqa: S307 (constants of our sources)
    except Exception:
        return None


def launch_bounds(values: dict[str, int]) -> dict[str, int]:
    """{kernel name: block size} from each __global__ function's __launch_bounds__."""
    out = {}
    for cu in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
        text = cu.read_text()
        for m in re.finditer(r"__global__\s+void\s+(__launch_bounds__\(([^,)]+)[^)]*\)\s*)?(\w+)",
                             text):  # fmt: skip
            name = m.group(3)
            if m.group(2) is None:
                sys.exit(f"check_cuda_static: {cu.name}: {name} declares no __launch_bounds__ "
                         "(the block size its launch uses)")  # fmt: skip
            threads = evaluate(m.group(2), values)
            if threads is None:
                sys.exit(f"check_cuda_static: {cu.name}: cannot evaluate {m.group(2)!r}")
            out[name] = threads
    return out


def occupancy(arch: int, regs: int, threads: int, smem: int) -> float:
    regs_sm, warps_sm, blocks_sm, smem_sm, reserved = SM[arch]
    warps = max(1, math.ceil(threads / 32))
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = (regs_sm // 4 // per_warp) * 4 // warps
    by_smem = smem_sm // (smem + reserved) if smem else blocks_sm
    blocks = min(by_regs, warps_sm // warps, by_smem, blocks_sm)
    return blocks * warps / warps_sm


INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)\s*(.*?)\s*;")
LOC = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
SECTION = re.compile(r"^\s*\.section\s+\.text\.(\S+?),")
LABEL = re.compile(r"^(\.L_x_\d+):")


def statement(sources: dict[str, list[str]], path: str, line: int) -> list[str]:
    """The source line and the lines that continue its statement (a formatter may wrap a
    marked statement, its comment landing on the last line)."""
    lines = sources.get(os.path.realpath(path), [])
    out = []
    for k in range(line - 1, min(line + 3, len(lines))):
        if k < 0:
            break
        out.append(lines[k])
        if lines[k].split("//")[0].rstrip().endswith((";", "{", "}")):
            break
    return out


def scalar_loads_in_loops(gi: str, sources: dict[str, list[str]]) -> dict[str, list[str]]:
    """{mangled kernel: [source places of 32-bit global loads in loops, not marked]}."""
    out: dict[str, list[str]] = {}
    for section in re.split(r"(?=^\s*\.section\s+\.text\.)", gi, flags=re.M):
        m = SECTION.match(section)
        if not m:
            continue
        name = m.group(1)
        instrs, labels, chain, pending = [], {}, [], []
        last_was_loc = False
        for line in section.splitlines():
            lm = LOC.match(line)
            if lm:
                if not last_was_loc:
                    chain = []
                chain.append((lm.group(1), int(lm.group(2))))
                last_was_loc = True
                continue
            last_was_loc = False
            lab = LABEL.match(line)
            if lab:
                pending.append(lab.group(1))
                continue
            im = INSTR.match(line)
            if im:
                addr = int(im.group(1), 16)
                for p in pending:
                    labels[p] = addr
                pending = []
                instrs.append((addr, im.group(2), im.group(3), list(chain)))
        loops = []
        for addr, op, ops, _ in instrs:
            if op.startswith("BRA"):
                t = re.search(r"`\((\.L_x_\d+)\)", ops)
                if t and t.group(1) in labels and labels[t.group(1)] <= addr:
                    loops.append((labels[t.group(1)], addr))
        bad = []
        for addr, op, _, where in instrs:
            if not op.startswith("LDG") or any(w in op for w in (".64", ".128", ".U8", ".S8",
                                                                 ".U16", ".S16")):  # fmt: skip
                continue
            if not any(lo <= addr <= hi for lo, hi in loops):
                continue
            if any(MARK in text for f, n in where for text in statement(sources, f, n)):
                continue
            bad.append(", ".join(f"{Path(f).name}:{n}" for f, n in where) or "?")
        if bad:
            out[name] = sorted(set(bad))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SM))
    ap.add_argument("--keep", help="write the cubins and disassembly into this folder")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every kernel")
    a = ap.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("check_cuda_static: no nvcc on PATH (the CUDA toolkit the build uses)")
    nvdisasm = find_nvdisasm()
    flags = nvcc_flags()
    values = constants()
    bounds = launch_bounds(values)
    sources = {os.path.realpath(p): Path(p).read_text().splitlines()
               for p in glob.glob(str(ROOT / "csrc" / "**" / "*"), recursive=True)
               if p.endswith((".h", ".cuh", ".cu", ".cpp"))}  # fmt: skip
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="cuda-static-"))
    work.mkdir(parents=True, exist_ok=True)
    units = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
    jobs = [(cu, arch) for arch in a.arch for cu in units]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        built = list(pool.map(lambda j: (j, compile_one(j[0], j[1], flags, work)), jobs))
    problems, rows = [], 0
    for (_, arch), (cubin, log) in built:
        res = parse_ptxas(log)
        gi = subprocess.run([nvdisasm, "-gi", str(cubin)], capture_output=True, text=True,
                            check=True).stdout  # fmt: skip
        if a.keep:
            (work / f"{cubin.stem}.gi").write_text(gi)
        scalar = scalar_loads_in_loops(gi, sources)
        names = demangle(list(res))
        for mangled, r in res.items():
            pretty = names[mangled]
            kernel = kernel_name(pretty)
            threads = bounds.get(kernel)
            if threads is None:
                problems.append(f"sm_{arch} {pretty}: no __launch_bounds__ found for {kernel}")
                continue
            occ = occupancy(arch, r["regs"], threads, r["smem"])
            rows += 1
            line = (f"sm_{arch} {pretty[:90]:90} regs {r['regs']:3} smem {r['smem']:6} "
                    f"threads {threads:4} occupancy {occ * 100:5.1f}%")  # fmt: skip
            if a.verbose:
                print(line)
            if r["spill_st"] or r["spill_ld"]:
                problems.append(f"{line}: spills {r['spill_st']} B stores, "
                                f"{r['spill_ld']} B loads")  # fmt: skip
            if occ < 0.5:
                problems.append(f"{line}: occupancy below 50%")
            for where in scalar.get(mangled, []):
                problems.append(f"sm_{arch} {pretty}: a 32-bit global load in a loop at {where} "
                                f"(wider, or mark its line \"{MARK} <why>\")")  # fmt: skip
    for p in problems:
        print(p)
    print(f"check-cuda-static: {rows} kernels for sm_{', sm_'.join(map(str, a.arch))}: "
          f"{len(problems)} problems (no spill, occupancy >= 50%, no unmarked 32-bit loads "
          "in loops)")  # fmt: skip
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
