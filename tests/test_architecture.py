"""The workspace's shape, checked from the sources (nothing is imported):

* no import circle inside any member, counting imports inside functions too (a lazy import
  that only dodges a circle is still one);
* no member imports another member's private module (a ``_name`` anywhere in its path), in
  its product or its benchmarks;
* no package's code or benchmark imports the app (``lab2_trainer``);
* each of the trainer's subpackages imports only what its ``__init__`` says under
  ``May import:``;
* no module is much over 700 lines, and ``docs/architecture.md`` names every trainer module.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
APP = "lab2_trainer"
MAX_LINES = 750  # "about 700"


def _members() -> dict[str, Path]:
    """Import name -> the member's folder, for every workspace member."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = {}
    for folder in config["tool"]["uv"]["workspace"]["members"]:
        for pkg in (ROOT / folder / "src").iterdir():
            if (pkg / "__init__.py").exists():
                found[pkg.name] = ROOT / folder
    return found


MEMBERS = _members()


def _module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every module (and ``module.name``) that ``path`` imports, anywhere in it."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def _sources() -> dict[str, tuple[Path, set[str]]]:
    """Module name -> (file, what it imports), for every member's product."""
    out = {}
    for name, folder in MEMBERS.items():
        src = folder / "src"
        for path in sorted((src / name).rglob("*.py")):
            module = _module_name(path, src)
            out[module] = (path, _imports(path, module))
    return out


SOURCES = _sources()


def _graph() -> dict[str, set[str]]:
    modules = set(SOURCES)
    return {m: {d for d in deps if d in modules and d != m} for m, (_, deps) in SOURCES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_in_any_member():
    graph = _graph()
    # A package's __init__ importing its own submodules is how a package exports; a
    # submodule importing its package's __init__ back is the circle to catch, so count the
    # edges from an __init__ down to its own submodules out.
    for m in graph:
        if SOURCES[m][0].name == "__init__.py":
            graph[m] = {d for d in graph[m] if not d.startswith(m + ".")}
    assert _cycles(graph) == []


def _first_party(deps: set[str]) -> set[str]:
    return {d for d in deps if d.split(".")[0] in MEMBERS}


def _benchmarks() -> dict[Path, tuple[str, set[str]]]:
    """Each benchmark script -> (its member's import name, what it imports)."""
    out = {}
    for name, folder in MEMBERS.items():
        for path in sorted((folder / "benchmarks").rglob("*.py")) if (
                folder / "benchmarks").exists() else []:
            out[path] = (name, _imports(path, path.stem))
    return out


def test_no_private_import_across_members():
    bad = []
    for module, (path, deps) in SOURCES.items():
        owner = module.split(".")[0]
        bad += [f"{path.relative_to(ROOT)}: {d}" for d in _first_party(deps)
                if d.split(".")[0] != owner and any(p.startswith("_") for p in d.split("."))]
    for path, (owner, deps) in _benchmarks().items():
        bad += [f"{path.relative_to(ROOT)}: {d}" for d in _first_party(deps)
                if d.split(".")[0] != owner and any(p.startswith("_") for p in d.split("."))]
    assert bad == []


def test_no_package_imports_the_app():
    bad = [f"{path.relative_to(ROOT)}" for module, (path, deps) in SOURCES.items()
           if not module.startswith(APP) and any(d.split(".")[0] == APP for d in deps)]
    bad += [f"{path.relative_to(ROOT)}" for path, (owner, deps) in _benchmarks().items()
            if owner != APP and any(d.split(".")[0] == APP for d in deps)]
    assert bad == []


def _unit(module: str) -> str | None:
    """The trainer's part a module belongs to: its subpackage, or a top-level module."""
    parts = module.split(".")
    return parts[1] if parts[0] == APP and len(parts) > 1 else None


def _allowed() -> dict[str, set[str] | None]:
    """Subpackage -> the parts it may import (None: any), from its ``May import:`` line."""
    rules: dict[str, set[str] | None] = {}
    for init in sorted((MEMBERS[APP] / "src" / APP).glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        match = re.search(r"May import: ([^.]*)\.", doc)
        assert match, f"{init.relative_to(ROOT)} does not say what it may import"
        said = match.group(1).strip()
        if said == "every subpackage":
            rules[init.parent.name] = None
        elif said == "nothing of the trainer":
            rules[init.parent.name] = set()
        elif said.startswith("every subpackage but "):
            rules[init.parent.name] = {"~" + p.strip() for p in re.split(
                r",| and ", said.removeprefix("every subpackage but ")) if p.strip()}
        else:
            rules[init.parent.name] = {p.strip() for p in said.split(",")}
    return rules


def test_trainer_subpackages_import_only_what_they_say():
    rules = _allowed()
    parts = set(rules) | {p.stem for p in (MEMBERS[APP] / "src" / APP).glob("*.py")}
    bad = []
    for module, (path, deps) in SOURCES.items():
        unit = _unit(module)
        if unit not in rules or rules[unit] is None:
            continue
        allowed = rules[unit]
        for dep in deps:
            target = _unit(dep)
            if target is None or target == unit or target not in parts:
                continue
            excluded = {a[1:] for a in allowed if a.startswith("~")}
            ok = target not in excluded if excluded else target in allowed
            if not ok:
                bad.append(f"{path.relative_to(ROOT)} imports {dep}")
    assert bad == []


def test_no_module_is_much_over_700_lines():
    long = [f"{path.relative_to(ROOT)}: {n}" for path, _ in SOURCES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert long == []


def test_the_architecture_page_names_every_trainer_module():
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [m for m in SOURCES if m.startswith(APP + ".")
               and SOURCES[m][0].name not in ("__init__.py", "__main__.py")
               and "/".join(m.split(".")[1:]) + ".py" not in page]
    assert missing == []
