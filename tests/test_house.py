"""The house rules that keep the layout one place per concern (docs/design.md, "Layout"):
the package's imports form a DAG with no relative import inside a function, and every
"Note [X] in <path>" names a file that holds Note [X]."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ruda_torch"


def _modules() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.glob("*.py"))}


def test_no_relative_import_inside_a_function():
    found = []
    for name, tree in _modules().items():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level > 0:
                    found.append(f"ruda_torch/{name}.py:{node.lineno} in {fn.name}()")
    assert not found, "relative imports inside functions hide import cycles: " + ", ".join(found)


def _imports_of(name: str, tree: ast.Module, names: set[str]) -> set[str]:
    """The package modules ``tree`` imports at its top level (``from . import a``,
    ``from .a import b``)."""
    out = set()
    for node in tree.body:
        nodes = [node]
        if isinstance(node, ast.Try):  # an optional import at the top level
            nodes = node.body
        for n in nodes:
            if isinstance(n, ast.ImportFrom) and n.level == 1:
                if n.module is None:
                    out.update(a.name for a in n.names if a.name in names)
                elif n.module.split(".")[0] in names:
                    out.add(n.module.split(".")[0])
    out.discard(name)
    return out


def test_package_imports_form_a_dag():
    modules = _modules()
    names = set(modules) | {"_C"}
    graph = {name: _imports_of(name, tree, names) for name, tree in modules.items()}
    order, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        if state.get(node) == "done" or node not in graph:
            return
        assert state.get(node) != "open", "import cycle: " + " -> ".join([*path, node])
        state[node] = "open"
        for dep in sorted(graph[node]):
            visit(dep, [*path, node])
        state[node] = "done"
        order.append(node)

    for node in sorted(graph):
        visit(node, [])
    assert graph["_common"] == set(), "_common is the leaf: it imports nothing of the package"


NOTE_REF = re.compile(r"Note \[([^\]]+)\][),.;:]? (?:in|of) `?([\w./-]+\.(?:py|h|cuh|cu|cpp|md))`?")
SOURCES = ("ruda_torch", "csrc", "tests", "tools", "benchmarks", "examples", "docs")


def test_every_note_reference_names_a_file_with_that_note():
    """ "Note [X] in path" must name a file that defines Note [X] (a line that is the Note's
    title, or "// Note [X]" / "# Note [X]" / a docstring line starting with it)."""
    bad = []
    files = [p for d in SOURCES for p in (ROOT / d).rglob("*") if p.is_file()
             and p.suffix in (".py", ".h", ".cuh", ".cu", ".cpp", ".md")]  # fmt: skip
    files += [p for p in ROOT.glob("*.md")]
    for path in files:
        text = path.read_text(errors="replace")
        flat = re.sub(r"\s*\n\s*(?://|#)?\s*", " ", text)  # references wrapped over comment lines
        for note, target in NOTE_REF.findall(flat):
            # From the root, or beside the file, or in the package or csrc/ for a bare name.
            candidates = [
                ROOT / target,
                path.parent / target,
                PACKAGE / target,
                ROOT / "csrc" / target,
            ]
            target_path = next((c for c in candidates if c.is_file()), None)
            if target_path is None:
                bad.append(f"{path.relative_to(ROOT)}: Note [{note}] in {target}: no such file")
                continue
            body = target_path.read_text(errors="replace")
            # A definition: a line that starts with the Note's name (after a comment
            # marker) and does not point elsewhere.
            title = rf"^\s*(?://|#)?\s*Note \[{re.escape(note)}\](?!,? (?:in|of) )"
            if not re.search(title, body, re.M):
                bad.append(f"{path.relative_to(ROOT)}: Note [{note}] is not defined in {target}")
    assert not bad, "\n".join(sorted(set(bad)))


# The files of csrc/ that may use the CPython and torch Python APIs (docs/building.md, "csrc
# layout"): the module, its host checks and handles, and the CPU ISA modules. Every other file
# is plain C++ over at::Tensor or raw pointers, which the emulated device also compiles.
PYTHON_API_FILES = {
    "csrc/module.cpp",
    "csrc/py_records.h",
    "csrc/py_checks.cpp",
    "csrc/py_flat.cpp",
    "csrc/cpu/dispatch.cpp",
    "csrc/cpu/kernels/isa_module.cpp",
}


def test_python_api_only_in_its_files():
    users = set()
    for path in sorted((ROOT / "csrc").rglob("*")):
        if path.suffix not in {".cpp", ".h", ".cu", ".cuh"}:
            continue
        text = path.read_text()
        if re.search(r"\bPyObject\b|[<\"]Python\.h[>\"]|python_variable\.h", text):
            users.add(path.relative_to(ROOT).as_posix())
    assert users == PYTHON_API_FILES, (
        f"CPython API outside its files: {sorted(users - PYTHON_API_FILES)}; "
        f"listed but unused: {sorted(PYTHON_API_FILES - users)}"
    )
