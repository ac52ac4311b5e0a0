"""The direction of imports: every module of every package is imported, and what it brought in is checked.

    tr_core     torch and transformers; never gradio, plotly, networkx, visualize, ui, app or benchmark
    visualize   plotly, networkx and, of tr_core, only the event types (tr_core.events; tr_core/__init__ is lazy);
                never torch, transformers, gradio, ui, app or benchmark
    ui          anything below it; never app or benchmark
    app.py, benchmark.py   the top: they wire the packages

Each package is imported in a fresh interpreter, one module after another, and each module is charged with the
modules that appeared in ``sys.modules`` while it was imported. A module that a sibling imported first is charged to
that sibling: the rules are per package, so a forbidden import is caught either way. The three interpreters run at
once (importing torch and gradio takes seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

FORBIDDEN = {  # package -> the top-level modules none of its modules may import
    "tr_core": {"gradio", "plotly", "networkx", "visualize", "ui", "app", "benchmark"},
    "visualize": {"torch", "transformers", "gradio", "ui", "app", "benchmark"},
    "ui": {"app", "benchmark"},
}
TR_CORE_FOR_VISUALIZE = {"tr_core", "tr_core.events"}  # the parts of tr_core visualize may import
# Within tr_core: the algorithm (its top-level modules) and the speed code never import the tools (benchmark, asset
# builders); the two backends below the seam (``tr_core.backend``: the native CPU kernels in tr_core.speed, the torch
# backend in tr_core.fixed) never import the decoding loop, the drafters, the methods or the engine above it.
ABOVE_THE_SEAM = {"tr_core.tools", "tr_core.beyond", "tr_core.rivals", "tr_core.engine", "tr_core.decoding",
                  "tr_core.drafters"}
WITHIN = {"tr_core": {"tr_core.tools"}, "tr_core.speed": ABOVE_THE_SEAM, "tr_core.fixed": ABOVE_THE_SEAM}
TOP = ("app", "benchmark")  # the top-level modules; they may import anything

# In a fresh interpreter: import each module named on the command line, in order, and print what each brought in.
PROBE = """
import importlib, json, sys
loaded = {}
for name in sys.argv[1:]:
    before = set(sys.modules)
    try:
        importlib.import_module(name)
    except Exception as e:
        loaded[name] = {"error": f"{type(e).__name__}: {e}"}
        continue
    loaded[name] = sorted(set(sys.modules) - before)
print("LOADED " + json.dumps(loaded))
"""


def package_modules(package: str) -> list[str]:
    """Every module of ``package`` and its subpackages (the package's ``__init__`` first), from the files on disk."""
    names = []
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return [package] + sorted(n for n in names if n != package)


def violations(loaded: dict[str, list[str]]) -> list[str]:
    """The imports that break the rules, as ``"<module> imports <name>"``; ``loaded`` maps each module imported to
    the modules that appeared while it was imported, e.g. ``{"tr_core.matrix": ["torch", "plotly"]}`` ->
    ``["tr_core.matrix imports plotly"]``."""
    found = []
    for module, names in loaded.items():
        package = module.split(".")[0]
        for name in names:
            top = name.split(".")[0]
            if top in FORBIDDEN.get(package, ()) or (
                    package == "visualize" and top == "tr_core" and name not in TR_CORE_FOR_VISUALIZE):
                found.append(f"{module} imports {name}")
            elif not module.startswith("tr_core.tools") and any(
                    module.startswith(within) and (name == banned or name.startswith(banned + "."))
                    for within, bans in WITHIN.items() for banned in bans):
                found.append(f"{module} imports {name}")
    return found


def import_all(groups: list[list[str]]) -> dict[str, list[str] | dict]:
    """Import each group of modules in its own fresh interpreter (all groups at once); what each module brought in."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRADIO_ANALYTICS_ENABLED": "False"}
    procs = [subprocess.Popen([sys.executable, "-c", PROBE, *group], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for group in groups]
    loaded = {}
    for group, proc in zip(groups, procs):
        out, err = proc.communicate(timeout=300)
        lines = [line for line in out.splitlines() if line.startswith("LOADED ")]
        assert proc.returncode == 0 and lines, f"importing {group[0]}... failed:\n{err[-2000:]}"
        loaded.update(json.loads(lines[-1][len("LOADED "):]))
    return loaded


@pytest.fixture(scope="module")
def loaded() -> dict[str, list[str] | dict]:
    # ui and the top share an interpreter: the top comes last, so nothing it imports is charged to a ui module
    return import_all([package_modules("tr_core"), package_modules("visualize"), package_modules("ui") + list(TOP)])


def test_every_module_imports(loaded):
    expected = package_modules("tr_core") + package_modules("visualize") + package_modules("ui") + list(TOP)
    assert list(loaded) == expected
    assert {"tr_core.engine", "tr_core.tools.bench", "visualize.charts", "ui.lesson"} <= set(loaded)
    failed = {module: names["error"] for module, names in loaded.items() if isinstance(names, dict)}
    assert not failed


def test_imports_go_one_way(loaded):
    assert violations({module: names for module, names in loaded.items() if isinstance(names, list)}) == []


def test_the_probe_sees_what_each_package_uses(loaded):
    # without these, the checks above would pass on an empty measurement
    def used(package):
        return {name.split(".")[0] for module, names in loaded.items() if module.split(".")[0] == package
                for name in names}

    assert {"torch", "transformers"} <= used("tr_core") and {"plotly", "networkx", "tr_core"} <= used("visualize")
    assert {"gradio", "torch"} <= used("ui") | used("app")


@pytest.mark.parametrize("module, names, broken", [
    ("tr_core.tools.bench", ["visualize", "visualize.charts", "plotly"], ["visualize", "visualize.charts", "plotly"]),
    ("tr_core.engine", ["torch", "transformers.models"], []),
    ("tr_core.tools.record_trace", ["ui.lesson", "gradio"], ["ui.lesson", "gradio"]),
    ("tr_core.models", ["networkx", "app"], ["networkx", "app"]),
    ("visualize.trace", ["tr_core", "tr_core.events", "plotly", "networkx"], []),
    ("visualize.tree_fig", ["tr_core.tree", "torch"], ["tr_core.tree", "torch"]),
    ("visualize.charts", ["transformers", "gradio", "benchmark"], ["transformers", "gradio", "benchmark"]),
    ("ui.session", ["torch", "tr_core.engine", "gradio", "visualize"], []),
    ("ui.page", ["app"], ["app"]),
    ("app", ["gradio", "torch", "ui", "visualize", "tr_core.engine"], []),
    ("benchmark", ["tr_core.tools.bench", "visualize.charts"], []),
    ("tr_core.decoding", ["tr_core.speed.kernels", "tr_core.tools.bench"], ["tr_core.tools.bench"]),
    ("tr_core.speed.kernels", ["tr_core.budget", "tr_core.beyond.context", "tr_core.engine"],
     ["tr_core.beyond.context", "tr_core.engine"]),
    ("tr_core.tools.bench", ["tr_core.engine", "tr_core.beyond.context"], []),
])
def test_the_checker_catches_each_broken_rule(module, names, broken):
    assert violations({module: names}) == [f"{module} imports {name}" for name in broken]


def test_no_module_imports_a_private_name_from_another():
    """A name with a leading underscore stays in its module: ``from x import _y`` (or ``x._y``) across modules of
    the project's packages and the top-level scripts is a sign that the name is part of an API and wants a public
    name (tests may look inside)."""
    import ast

    ours = {"tr_core", "visualize", "ui", "app", "benchmark"}
    files = [p for package in ("tr_core", "visualize", "ui") for p in (ROOT / package).rglob("*.py")]
    found = []
    for path in files + [ROOT / "app.py", ROOT / "benchmark.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] in ours):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert found == []


def test_app_py_is_wiring_no_function_over_forty_lines():
    import ast

    tree = ast.parse((ROOT / "app.py").read_text())
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 40]
    assert long == []


# --- the seam, read from the source (issue 54): every import statement, at module level or inside a function ---------

BELOW_ROOMS = ("tr_core.speed", "tr_core.fixed")  # the two backends' rooms
# the algorithm (every top-level module of tr_core but the seam itself, the drafts beyond the paper, the rivals) and
# the app ask the seam (tr_core.backend); the tools (benchmark, calibration reports) may read a room directly
KEEP_OUT_OF_ROOMS = [p for p in sorted((ROOT / "tr_core").glob("*.py")) if p.name != "backend.py"] + sorted(
    (ROOT / "tr_core" / "beyond").glob("*.py")) + sorted((ROOT / "tr_core" / "rivals").glob("*.py")) + sorted(
    (ROOT / "ui").glob("*.py")) + [ROOT / "app.py"]
ABOVE_ROOMS = ("tr_core.decoding", "tr_core.drafters", "tr_core.engine", "tr_core.methods", "tr_core.hf",
               "tr_core.tools", "tr_core.beyond", "tr_core.rivals", "tr_core.fitting", "ui", "app")


def imported_names(path) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved against its package), wherever the
    statement stands."""
    import ast

    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}  # `from . import layouts` names a module too
    return names


def under(name: str, roots) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def test_the_algorithm_and_the_app_import_nothing_from_a_backends_room():
    assert {"engine.py", "fitting.py", "decoding.py", "matrix.py", "context.py", "app.py"} <= {
        p.name for p in KEEP_OUT_OF_ROOMS}
    crossing = [f"{p.relative_to(ROOT)} imports {n}" for p in KEEP_OUT_OF_ROOMS for n in sorted(imported_names(p))
                if under(n, BELOW_ROOMS)]
    assert not crossing, crossing


def test_a_backends_room_imports_nothing_from_above_the_seam():
    rooms = sorted((ROOT / "tr_core" / "speed").glob("*.py")) + sorted((ROOT / "tr_core" / "fixed").glob("*.py"))
    upward = [f"{p.relative_to(ROOT)} imports {n}" for p in rooms for n in sorted(imported_names(p))
              if under(n, ABOVE_ROOMS)]
    assert not upward, upward


def test_the_source_reader_sees_relative_imports_and_imports_inside_functions(tmp_path):
    assert "tr_core.speed.backend.NativeBackend" in imported_names(ROOT / "tr_core" / "backend.py")  # in a function
    assert "tr_core.tree.TreeBuffers" in imported_names(ROOT / "tr_core" / "fixed" / "backend.py")  # from ..tree


def import_circles(modules: dict[str, Path]) -> list[set[str]]:
    """The strongly connected sets of more than one module in the graph of every import statement (a module's import
    of its own package left out)."""
    graph = {m: {n for n in imported_names(p) if n in modules and n != m and not m.startswith(n + ".")}
             for m, p in modules.items()}
    order, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        order[v] = low[v] = len(order)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            knot = set()
            while not knot or w != v:
                w = stack.pop()
                on.discard(w)
                knot.add(w)
            if len(knot) > 1:
                found.append(knot)

    for v in graph:
        if v not in order:
            visit(v)
    return found


def test_no_import_circle_anywhere_even_through_an_import_inside_a_function():
    files = [p for root in ("tr_core", "ui", "visualize") for p in (ROOT / root).rglob("*.py")]
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p for p in files}
    circles = import_circles(modules)
    assert circles == [], circles


def test_the_circle_finder_finds_a_circle_hidden_in_a_function(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import x\n")
    (tmp_path / "c.py").write_text("from a import y\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_circles({m: tmp_path / f"{m}.py" for m in "abc"}) == [{"a", "b", "c"}]


def test_an_import_inside_a_function_says_why():
    """In tr_core, an import statement inside a function is there for a reason it gives: an optional package (under
    ``try``), a comment on its line, or the seam (``tr_core/backend.py``, whose docstring says why each backend's
    room is imported where it is chosen). Anything else goes at the top of its module, where the circle test sees it
    like any other."""
    import ast

    unexplained = []
    for path in sorted((ROOT / "tr_core").rglob("*.py")):
        if path == ROOT / "tr_core" / "backend.py":
            continue
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        guarded = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) for s in t.body for n in ast.walk(s)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.col_offset > 0 and id(node) not in guarded \
                    and "#" not in lines[node.end_lineno - 1] and not lines[node.lineno - 2].strip().startswith("#"):
                unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert unexplained == [], unexplained
