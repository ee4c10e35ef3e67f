"""The reference pages document everything once, and the README leads to each.

Every public name, every command and every environment variable is defined in exactly one reference
page (``docs/*.md`` but design.md, the architecture), in a definition table: a Markdown table whose
first header cell is ``name``, ``command`` or ``variable``. The first cell of a row holds what the
row defines, in backticks:

- names: a qualified name, ``lancet_rt.parallel.replicate(model, mesh)``, then short names that
  continue its module (``Replicated``); ``(also `lancet_rt.moe.MoE`)`` names an alias of the same object;
- commands: ``make T``, ``python -m M ...``, ``torchrun ... -m M ...``, ``lancet-autotune ...``;
- variables: ``LANCET_X``, or a family ``LANCET_X_<A|B>``.

The README's reference table (first header cell ``page``) lists every public name in the row of the
page that defines it. Links between the pages resolve, anchors included. Reference pages start with
an example and end with their limits. The examples themselves run in tests/test_readme.py.

docs/design.md's module tree names every module and folder of kernels/, lancet_rt/ and autotune/,
and nothing else under them; ``python -m tests.test_docs`` lists where they disagree.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
from pathlib import Path

from tests.test_layout import _modules

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.glob("*.md") if p.name != "design.md")  # the reference pages
MAX_README_LINES = 300

# Public names of modules that have no __all__ (every module that has one counts all of it).
EXTRA_PUBLIC = {
    "lancet_rt.comm.faults": ("GroupError", "PeerError", "PeerTimeout", "CollectiveMismatch"),
    "lancet_rt.comm.group": ("as_group",),
    "lancet_rt.comm.emulated_skew": ("SkewedGroup",),
    "lancet_rt.dense": ("RMSNorm", "add_rmsnorm", "linear_cross_entropy", "LinearCrossEntropy"),
    "lancet_rt.models.blocks": ("MoEBlocks", "Block", "CausalSelfAttention"),
    "lancet_rt.schedule.balance": ("transformer_costs", "balanced_bounds"),
    "lancet_rt.routing.traces": (
        "RoutingTrace",
        "RoutingSource",
        "parse_routing",
        "bias_routers",
        "zipf_shares",
        "zipf_exponent",
    ),
}
KINDS = ("name", "command", "variable")
ENV_PATTERN = re.compile(r"\b((?:LANCET|TRITON)_[A-Z0-9_]*[A-Z0-9])\b")


# ------------------------------------------------------------------------------------------ parsing
def _cells(line: str) -> list[str]:
    """The cells of a Markdown table row (an escaped ``\\|`` stays inside its cell)."""
    parts = re.split(r"(?<!\\)\|", line.strip())
    return [c.strip() for c in parts[1:-1]]


def tables(text: str):
    """(header cells, [row cells]) of every Markdown table in ``text``."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s|:-]+\|$", lines[i + 1].strip()):
            header, rows, i = _cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            yield header, rows
        else:
            i += 1


def _spans(cell: str) -> list[str]:
    return [s.replace("\\|", "|") for s in re.findall(r"`([^`]+)`", cell)]


def cell_names(cell: str) -> list[str]:
    """Qualified names in a cell: ``lancet_rt.a.b(...)`` spans, and short names continuing the last one's module."""
    names, module = [], None
    for span in _spans(cell):
        m = re.match(r"[A-Za-z_][\w.]*", span)
        if not m:
            continue
        dotted = m.group(0)
        if dotted.startswith("lancet_rt."):
            module = dotted.rpartition(".")[0]
            names.append(dotted)
        elif module and "." not in dotted and (span == dotted or span.startswith(dotted + "(")):
            names.append(f"{module}.{dotted}")
    return names


def command_of(span: str) -> str:
    """The command a span runs: ``make T``, ``python -m M`` (also under torchrun) or the program."""
    words = span.split()
    if words[0] == "make":
        return f"make {words[1]}"
    if "-m" in words:
        return f"python -m {words[words.index('-m') + 1]}"
    return words[0]


def definitions(kind: str, pages=PAGES) -> dict[str, set[str]]:
    """What the ``kind`` tables of ``pages`` define -> the page names defining it."""
    found: dict[str, set[str]] = {}
    for page in pages:
        for header, rows in tables(page.read_text()):
            if header[0] != kind:
                continue
            for row in rows:
                if kind == "name":
                    items = cell_names(row[0])
                elif kind == "command":
                    items = [command_of(s) for s in _spans(row[0])]
                else:
                    items = [s.split("<")[0] for s in _spans(row[0])]
                for item in items:
                    found.setdefault(item, set()).add(page.name)
    return found


# ------------------------------------------------------------------------------------------ the code
def resolve(qualified: str):
    """The object a qualified name documents: attributes first, then submodules (as ``import`` finds them)."""
    parts = qualified.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(".".join(parts[: i + 1]))
    return obj


def identity(qualified: str, obj) -> object:
    """Aliases of one class, function or module are one thing to document; a constant is its name."""
    if inspect.ismethod(obj):  # (a classmethod is bound afresh at each access: its function is the thing)
        obj = obj.__func__
    if inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj):
        return id(obj)
    return qualified


def _all_of(path: Path):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def public_names() -> list[str]:
    """Every name of every ``__all__`` of the installed packages, and :data:`EXTRA_PUBLIC`."""
    names = []
    for module, path in sorted(_modules().items()):
        listed = _all_of(path)
        names += [f"{module}.{n}" for n in listed or ()]
    for module, listed in EXTRA_PUBLIC.items():
        names += [f"{module}.{n}" for n in listed]
    return names


def _main_modules() -> list[str]:
    """Installed and bench modules that run as ``python -m``."""

    def runs(path: Path) -> bool:
        return re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M) is not None

    found = [m.removesuffix(".__main__") for m, p in _modules().items() if runs(p)]
    found += [f"bench.{p.stem}" for p in sorted((ROOT / "bench").glob("*.py")) if runs(p)]
    return sorted(found)


def commands() -> list[str]:
    """Every command: the Makefile's targets, the ``python -m`` modules, the installed scripts."""
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    scripts = re.search(r"^\[project\.scripts\]\n((?:[\w-]+ = .*\n)+)", (ROOT / "pyproject.toml").read_text(), re.M)
    return (
        [f"make {t}" for t in phony]
        + [f"python -m {m}" for m in _main_modules()]
        + [line.split(" = ")[0] for line in scripts.group(1).splitlines()]
    )


def _sources() -> str:
    return "\n".join(
        p.read_text() for folder in ("lancet_rt", "kernels", "autotune") for p in sorted((ROOT / folder).rglob("*.py"))
    )


# ------------------------------------------------------------------------------------------ the checks
def _once(expected: list[str], defined: dict[str, set[str]], what: str) -> None:
    missing = [e for e in expected if e not in defined]
    twice = {e: sorted(pages) for e, pages in defined.items() if len(pages) > 1}
    unknown = sorted(set(defined) - set(expected))
    assert not missing, f"{what} in no reference page's table: {missing}"
    assert not twice, f"{what} defined in more than one page: {twice}"
    assert not unknown, f"{what} documented but not in the code: {unknown}"


def _by_identity(defined: dict[str, set[str]]) -> dict[object, set[str]]:
    pages: dict[object, set[str]] = {}
    for name, where in defined.items():
        pages.setdefault(identity(name, resolve(name)), set()).update(where)
    return pages


def test_every_public_name_is_defined_in_exactly_one_page():
    defined = definitions("name")
    unresolved = []
    for name in defined:
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            unresolved.append(f"{name} ({exc})")
    assert not unresolved, f"documented names that do not exist: {unresolved}"
    by_object = _by_identity(defined)
    twice = {
        n: sorted(by_object[identity(n, resolve(n))]) for n in defined if len(by_object[identity(n, resolve(n))]) > 1
    }
    assert not twice, f"one object defined in several pages: {twice}"
    missing = [n for n in public_names() if identity(n, resolve(n)) not in by_object]
    assert not missing, f"public names in no reference page's table: {missing}"


def test_readme_lists_every_public_name_in_its_page_row():
    defined = _by_identity(definitions("name"))
    listed: dict[object, set[str]] = {}
    ((header, rows),) = [t for t in tables(README.read_text()) if t[0][0] == "page"]
    for row in rows:
        page = re.search(r"\]\(docs/([\w-]+\.md)", row[0]).group(1)
        for name in cell_names(row[2]):
            listed.setdefault(identity(name, resolve(name)), set()).add(page)
    wrong = [n for n in public_names() if listed.get(identity(n, resolve(n))) != defined.get(identity(n, resolve(n)))]
    assert not wrong, f"public names not in the README row of the page that defines them: {wrong}"
    stray = [k for k, v in listed.items() if v != defined.get(k)]
    assert not stray, f"README rows naming what their page does not define: {len(stray)}"


def test_every_command_is_defined_in_exactly_one_page():
    defined = definitions("command")
    _once(commands(), defined, "commands")
    benches = [c for c in commands() if c.startswith("python -m bench.")]
    assert benches and all(defined[c] == {"benchmarks.md"} for c in benches), {c: sorted(defined[c]) for c in benches}


def test_every_environment_variable_is_defined_in_exactly_one_page():
    source = _sources()
    defined = definitions("variable")
    families = [v for v in defined if v.endswith("_")]
    for family in families:  # LANCET_GEMM_CONFIG_<OP>: the prefix the code builds from
        assert family.rstrip("_") in source, family
    read = set(ENV_PATTERN.findall(source)) | _env_names()  # (env.py also reads CUDA's own variables)
    _once(sorted(read), {k: v for k, v in defined.items() if k not in families}, "environment variables")


def _env_names() -> set[str]:
    """The variables lancet_rt/env.py names: its module-level ``NAME = "NAME..."`` string constants."""
    names = set()
    for node in ast.parse((ROOT / "lancet_rt" / "env.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            if re.fullmatch(r"[A-Z][A-Z0-9_]*", node.value.value):
                names.add(node.value.value)
    return names


def test_the_parsers_see_what_they_must():
    # The checks above must be able to fail: a definition table, an alias, a continued short name,
    # a command under torchrun, a family of variables, and a table of another kind that defines nothing.
    text = (
        "| name | what |\n|---|---|\n| `lancet_rt.MoE(d)` (also `lancet_rt.moe.MoE`), `Experts` | x |\n\n"
        "| command | what |\n|---|---|\n| `torchrun --nproc-per-node 2 -m bench.train_lm`, `make test` | x |\n\n"
        "| variable | effect |\n|---|---|\n| `LANCET_GEMM_CONFIG_<FWD\\|DX>` | x |\n\n"
        "| folder | what |\n|---|---|\n| `lancet_rt.Overlapped` | x |\n"
    )
    import tempfile

    page = Path(tempfile.mkdtemp()) / "page.md"
    page.write_text(text)
    assert definitions("name", [page]) == {
        n: {"page.md"} for n in ("lancet_rt.MoE", "lancet_rt.moe.MoE", "lancet_rt.moe.Experts")
    }
    assert len(_by_identity(definitions("name", [page]))) == 2  # MoE and its alias are one object
    assert set(definitions("command", [page])) == {"python -m bench.train_lm", "make test"}
    assert set(definitions("variable", [page])) == {"LANCET_GEMM_CONFIG_"}
    assert "make gpu-wheels" in commands() and "lancet-autotune" in commands()
    assert "python -m lancet_rt.autotune" in commands() and "python -m bench.overlap" in commands()
    assert "lancet_rt.parallel.fully_shard" in public_names() and "lancet_rt.comm.faults.PeerError" in public_names()


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_resolve():
    broken = []
    for page in [README, *PAGES, DOCS / "design.md", ROOT / "bench" / "results" / "HISTORY.md"]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"https?://", target):
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken


def test_readme_is_a_front_page_leading_to_every_page():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", text))
    assert linked >= {p.name for p in DOCS.glob("*.md")}, sorted({p.name for p in DOCS.glob("*.md")} - linked)


def test_reference_pages_start_with_an_example_and_end_with_their_limits():
    for page in PAGES:
        text = page.read_text()
        first_section = text.find("\n## ")
        assert 0 <= text.find("\n```") < first_section, f"{page.name}: no example before its first section"
        assert re.findall(r"^## (.*)$", text, re.M)[-1] == "Limits", f"{page.name}: does not end with its limits"


def test_no_wheel_is_tracked():
    listing = subprocess.run(["git", "ls-files", "*.whl"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert listing.stdout.split() == []


# ------------------------------------------------------------------------------------------ the module tree
# docs/design.md's "Module tree" is a code block of entries: a folder (``moe/``) or modules
# (``env.py, trace.py``) at some column, then two spaces and what they hold. An entry belongs to the
# nearest folder above it that starts at a smaller column (``parallel/  mesh.py`` then ``sync.py``
# under ``mesh.py``: both in parallel/); ``integrations/hf.py`` names a folder and a module at once.
# Lines indented by TREE_PROSE_COLUMN or more continue a description.
TREE_FOLDERS = ("kernels", "lancet_rt", "autotune")  # the installed packages, checked both ways
TREE_PROSE_COLUMN = 24
_TREE_ENTRY = re.compile(r"(?:[\w.-]+/)*(?:[\w.-]+\.py|[\w.-]+/)")


def tree_block(text: str) -> str:
    """The code block under design.md's ``## Module tree`` heading."""
    found = re.search(r"^## Module tree\n.*?^```\n(.*?)^```", text, re.S | re.M)
    assert found, "design.md has no code block under a '## Module tree' heading"
    return found.group(1)


def tree_paths(block: str) -> set[str]:
    """The folders (``lancet_rt/moe/``) and modules (``lancet_rt/moe/layer.py``) a tree block names."""
    paths: set[str] = set()
    stack: list[tuple[int, str]] = []  # (column, folder) of the folders the current line may be in
    for line in block.splitlines():
        if len(line) - len(line.lstrip()) >= TREE_PROSE_COLUMN:
            continue
        for token in re.finditer(r"[^\s,]+", line):
            if not _TREE_ENTRY.fullmatch(token.group()):
                break  # the description begins
            while stack and stack[-1][0] >= token.start():
                stack.pop()
            path = (stack[-1][1] if stack else "") + token.group()
            parts = path.rstrip("/").split("/")
            paths.update("/".join(parts[:i]) + "/" for i in range(1, len(parts)))
            paths.add(path)
            if path.endswith("/"):
                stack.append((token.start(), path))
    return paths


def code_paths(folders=TREE_FOLDERS) -> set[str]:
    """The folders and modules of ``folders`` on disk (a package's ``__init__.py`` is its folder)."""
    paths = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            paths.add(relative.rpartition("/")[0] + "/" if path.name == "__init__.py" else relative)
    return paths


def tree_differences(text: str | None = None, folders=TREE_FOLDERS) -> tuple[list[str], list[str]]:
    """(missing, extra): modules and folders of ``folders`` that design.md's tree omits, and entries
    of the tree under ``folders`` that do not exist. An ``__init__.py`` may be named (its folder is)."""
    named = tree_paths(tree_block(text if text is not None else (DOCS / "design.md").read_text()))
    named = {p for p in named if p.split("/")[0] in folders}
    present = code_paths(folders)
    inits = {p.removesuffix("__init__.py") for p in named if p.endswith("/__init__.py")}
    missing = sorted(present - named - inits)
    extra = sorted(p for p in named - present if p.removesuffix("__init__.py") not in present)
    return missing, extra


def test_the_module_tree_matches_the_code():
    missing, extra = tree_differences()
    assert not missing, f"modules or folders not in docs/design.md's module tree: {missing}"
    assert not extra, f"docs/design.md's module tree names what does not exist: {extra}"


def test_the_tree_parser_sees_what_it_must():
    block = (
        "kernels/                      -> lancet_rt.kernels\n"
        "  gating.py, _topk.py         launchers: scores, top-k\n"
        "                              moe/fake.py: a description going on\n"
        "lancet_rt/\n"
        "  parallel/  mesh.py          meshes\n"
        "             sync.py          sync\n"
        "  moe/       dispatch/        the dispatchers\n"
        "               base.py        the protocols\n"
        "  integrations/hf.py          from_hf\n"
    )
    assert tree_paths(block) == {
        "kernels/", "kernels/gating.py", "kernels/_topk.py", "lancet_rt/", "lancet_rt/parallel/",
        "lancet_rt/parallel/mesh.py", "lancet_rt/parallel/sync.py", "lancet_rt/moe/", "lancet_rt/moe/dispatch/",
        "lancet_rt/moe/dispatch/base.py", "lancet_rt/integrations/", "lancet_rt/integrations/hf.py",
    }  # fmt: skip
    missing, extra = tree_differences(f"# d\n\n## Module tree\n\n```\n{block}```\n")
    assert "lancet_rt/moe/layer.py" in missing and "autotune/" in missing and not extra
    block += "  schedule/  gone.py          moved away\n"
    assert tree_differences(f"## Module tree\n\n```\n{block}```\n")[1] == ["lancet_rt/schedule/gone.py"]


if __name__ == "__main__":  # python -m tests.test_docs: what the module tree and the code disagree on
    missing, extra = tree_differences()
    print(
        "\n".join(
            [f"missing from docs/design.md's tree: {p}" for p in missing]
            + [f"in the tree, not in the code: {p}" for p in extra]
        )
        or "docs/design.md's module tree matches the code"
    )
    raise SystemExit(1 if missing or extra else 0)
