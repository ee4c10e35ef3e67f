"""The layout's rules (docs/design.md, "Layers"), checked on the source tree.

- one name per module: no symbolic link in the repository (kernels/ and autotune/ are the packages
  lancet_rt.kernels and lancet_rt.autotune through setuptools' package-dir, not through links);
- no import cycle among the modules of lancet_rt, lancet_rt.kernels, lancet_rt.autotune and bench,
  counting imports inside functions too (only ``if TYPE_CHECKING:`` blocks are left out: they never run);
- floors: each package of ours (:data:`FLOORS`) imports only packages on lower floors, imports
  inside functions included, so packages never import each other both ways (the core never imports
  the autotuner, ``chunks="auto"`` resolves through lancet_rt.schedule.policy; kernels/ never imports
  the runtime);
- no import of a private name (``_name``, a module or an attribute) from another package;
- files a reader can hold: at most 500 lines of code per source file, 80 per function (Triton kernels
  exempt), counted as ``ruff format`` lays them out: blank lines, comments and docstrings not counted.
"""

from __future__ import annotations

import ast
import io
import subprocess
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# folder -> the installed package it is (pyproject.toml's package-dir)
PACKAGES = {"lancet_rt": "lancet_rt", "kernels": "lancet_rt.kernels", "autotune": "lancet_rt.autotune"}
# The floors, lowest first (docs/design.md, "Layers and what each may import"): a package imports only
# packages on floors below its own; packages on one floor do not import each other. A package is a
# folder of lancet_rt or one of its top-level modules; "lancet_rt" alone is the public API (__init__.py).
FLOORS: list[tuple[str, ...]] = [
    ("lancet_rt.kernels",),  # Triton kernels, launchers, references: torch and triton only
    ("lancet_rt.env", "lancet_rt.trace", "lancet_rt.jsonfile", "lancet_rt.cli"),  # leaves
    ("lancet_rt.ops",),  # kernel selection
    ("lancet_rt.runtime",),  # a step's state: chunk scope, dW queue, casts, recompute
    ("lancet_rt.comm",),  # groups, the emulated link, monitors, the fault protocol
    ("lancet_rt.routing", "lancet_rt.dense"),  # router and routing Functions; dense layers
    ("lancet_rt.moe",),  # the MoE layer, experts, dispatchers
    ("lancet_rt.schedule", "lancet_rt.checkpoint"),  # the drivers of a step; checkpoints
    ("lancet_rt.integrations",),  # from_hf
    ("lancet_rt.parallel",),  # data-parallel engines over meshes
    ("lancet_rt.models",),  # shared models built from the layers
    ("lancet_rt",),  # the public API
    ("lancet_rt.autotune",),  # registers chunks="auto" on import
]
# Module cycles allowed, each with its reason. Empty is the goal.
CYCLE_EXCEPTIONS: list[list[str]] = []
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
# Files allowed past a limit, with the reason (docs/design.md repeats them). Empty is the goal.
FILE_EXCEPTIONS: dict[str, str] = {}
FUNCTION_EXCEPTIONS: dict[str, str] = {}


def _modules(bench: bool = False) -> dict[str, Path]:
    """Installed module name -> source file, for every .py file of the three packages (and bench/)."""
    found = {}
    folders = {**PACKAGES, "bench": "bench"} if bench else PACKAGES
    for folder, package in folders.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node that can run, at any depth."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (the deepest one each import statement names)."""
    edges = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bases = [alias.name for alias in node.names]
                names = [None]
            else:
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                else:
                    base = node.module
                bases = [base]
                names = [alias.name for alias in node.names]
            for base in bases:
                for n in names:
                    candidate = f"{base}.{n}" if n else base
                    while candidate and candidate not in modules:
                        candidate = candidate.rpartition(".")[0]
                    if candidate and candidate != name:
                        targets.add(candidate)
        edges[name] = targets
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_symlinks_in_the_repository():
    listing = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True)
    if listing.returncode != 0:
        pytest.fail(f"git ls-files failed: {listing.stderr}")
    links = [line.split("\t", 1)[1] for line in listing.stdout.splitlines() if line.startswith("120000")]
    assert links == [], f"symbolic links in the repository: {links}"


def test_no_import_cycles():
    cycles = [c for c in _cycles(_edges(_modules(bench=True))) if c not in CYCLE_EXCEPTIONS]
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _package(module: str) -> str:
    """The package of FLOORS that ``module`` belongs to (the longest listed prefix)."""
    listed = {p for floor in FLOORS for p in floor}
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in listed and (n > 1 or module == "lancet_rt"):
            return candidate
    raise AssertionError(f"{module} is on no floor: add its package to FLOORS (and to docs/design.md)")


def _floor_violations(edges: dict[str, set[str]]) -> list[str]:
    floor = {p: i for i, names in enumerate(FLOORS) for p in names}
    bad = []
    for name, targets in edges.items():
        for t in targets:
            a, b = _package(name), _package(t)
            if a != b and floor[b] >= floor[a]:
                bad.append(f"{name} -> {t} ({a} is on floor {floor[a]}, {b} on floor {floor[b]})")
    return sorted(bad)


def test_each_package_imports_only_lower_floors():
    bad = _floor_violations(_edges(_modules()))
    assert bad == [], "imports not downward:\n" + "\n".join(bad)


def test_the_floor_rule_sees_an_upward_import():
    # An import inside a function counts; one under ``if TYPE_CHECKING:`` does not.
    edges = _edges(
        {
            "lancet_rt.comm.a": _write("a.py", "def f():\n    from lancet_rt.moe import b\n"),
            "lancet_rt.moe.b": _write(
                "b.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import lancet_rt.schedule.c\n"
            ),
            "lancet_rt.schedule.c": _write("c.py", ""),
        }
    )
    assert [v.split(" (")[0] for v in _floor_violations(edges)] == ["lancet_rt.comm.a -> lancet_rt.moe.b"]


def _private_imports(modules: dict[str, Path]) -> list[str]:
    """Imports of a name or module starting with "_" from another package (``__future__`` and dunders aside)."""
    bad = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                pairs = [(alias.name, None) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                pairs = [(base, alias.name) for alias in node.names]
            for base, n in pairs:
                if not base.startswith("lancet_rt") or _package(_owner(base, modules)) == _package(name):
                    continue
                dotted = base.split(".") + ([n] if n else [])
                if any(part.startswith("_") and not part.startswith("__") for part in dotted):
                    bad.append(f"{name}: {base}{'.' + n if n else ''}")
    return sorted(bad)


def _owner(base: str, modules: dict[str, Path]) -> str:
    while base not in modules and "." in base:
        base = base.rpartition(".")[0]
    return base


def test_no_private_name_imported_across_packages():
    bad = _private_imports(_modules())
    assert bad == [], "private names imported from another package:\n" + "\n".join(bad)


def test_the_cycle_finder_sees_a_cycle():
    # The check above must be able to fail: a two-module loop and a function-level import are found.
    edges = _edges(
        {
            "lancet_rt.a": _write("a.py", "def f():\n    from lancet_rt import b\n"),
            "lancet_rt.b": _write("b.py", "from lancet_rt.a import f\n"),
            "lancet_rt": _write("__init__.py", ""),
        }
    )
    assert _cycles(edges) == [["lancet_rt.a", "lancet_rt.b"]]


def _write(name: str, text: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp()) / name
    path.write_text(text)
    return path


def _sources():
    for folder in ("kernels", "lancet_rt", "autotune", "bench", "examples"):
        yield from sorted((REPO / folder).rglob("*.py"))


def _code_lines(source: str) -> set[int]:
    """The numbers of the lines that hold code: not blank, not only a comment, not in a docstring."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstrings)
    return lines


def test_the_line_count_leaves_out_comments_blank_lines_and_docstrings():
    source = 'def f(x):\n    """doc\n    string"""\n\n    # a comment\n    return (x +\n            1)\n'
    assert _code_lines(source) == {1, 6, 7}


def test_files_a_reader_can_hold():
    long = {}
    for path in _sources():
        rel = str(path.relative_to(REPO))
        n = len(_code_lines(path.read_text()))
        if n > MAX_FILE_LINES and rel not in FILE_EXCEPTIONS:
            long[rel] = n
    assert long == {}, f"files over {MAX_FILE_LINES} lines of code: {long}"


def _is_triton_kernel(fn) -> bool:
    return any("jit" in ast.unparse(d) or "autotune" in ast.unparse(d) for d in fn.decorator_list)


def test_functions_a_reader_can_hold():
    long = {}
    for path in _sources():
        rel = str(path.relative_to(REPO))
        source = path.read_text()
        code = _code_lines(source)
        for node in ast.walk(ast.parse(source, rel)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_triton_kernel(node):
                n = sum(1 for line in code if node.lineno <= line <= node.end_lineno)
                key = f"{rel}:{node.name}"
                if n > MAX_FUNCTION_LINES and key not in FUNCTION_EXCEPTIONS:
                    long[key] = n
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines of code: {long}"


def test_the_private_rule_sees_a_private_import_from_another_package():
    # Within a package private names are free; from another package, a private module or name is not.
    modules = {
        "lancet_rt.moe.b": _write("b.py", "_x = 1\n"),
        "lancet_rt.moe.c": _write("c.py", "from lancet_rt.moe.b import _x\n"),
        "lancet_rt.comm._d": _write("_d.py", ""),
        "lancet_rt.schedule.e": _write("e.py", "from lancet_rt.moe.b import _x\nfrom lancet_rt.comm import _d\n"),
    }
    assert _private_imports(modules) == [
        "lancet_rt.schedule.e: lancet_rt.comm._d",
        "lancet_rt.schedule.e: lancet_rt.moe.b._x",
    ]
