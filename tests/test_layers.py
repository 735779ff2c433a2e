"""The package's layers point one way: no import cycle, and no module imports from a layer above
its own (stats/ at the bottom; detectors, sinks, capture above; the monitor on top).

The graph comes from the package's own `import` / `from` statements, read with ast (nothing is
imported): every statement counts, the ones inside functions too (a late import is still a
dependency), except those under `if TYPE_CHECKING:`. Importing a.b.c runs the `__init__` of a and
a.b first, so those count as imported too."""
from __future__ import annotations

import ast
import fnmatch
import functools
from pathlib import Path

import pytest

PKG = "stabilitywatch"
ROOT = Path(__file__).resolve().parent.parent / PKG

# Bottom first. A module may import modules of its own layer and of the layers below. Patterns
# are names below the package ("config_*" matches a top-level module, "capture.policy" a module
# and what is inside it); the longest matching pattern decides.
LAYERS = (
    ("row schema", ("formats", "stats")),                    # where a statistic is defined
    ("kernels", ("kernels",)),                               # where it is computed on a device
    ("vocabulary", ("alert", "extensions")),                 # Alert, the Detector/Sink protocols
    # capture.policy: the capture triggers' vocabulary, which Config validates
    ("config", ("config", "config_*", "capture.policy")),
    ("parts", ("hooks", "detectors", "shadow", "sinks", "capture", "distributed", "incidents",
               "schedule", "pacing", "escalation", "guard", "inplace", "processing", "records", "observe_args", "rundir", "report",
               "integrations.accelerate", "integrations.fp8")),
    ("monitor", ("monitor", "handling")),
    ("entry points", ("", "__main__", "cli", "demo", "replaying", "integrations")),
)

# Known cycles, each removed by work under way; delete an entry once its cycle is gone (the test
# says when).
ALLOWED_CYCLES: set = set()
# Known imports from a layer above, removed the same way.
ALLOWED_UPWARD: set = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else getattr(t, "attr", None)
            if name == "TYPE_CHECKING":
                skip |= {id(d) for c in node.body for d in ast.walk(c)}
    return skip


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """The package's modules that importing `name` runs (names below the package)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_only(tree)
    here = [PKG] + (name.split(".") if name else [])
    if path.name != "__init__.py":
        here.pop()   # a module's relative imports start from its package
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets.add(mod)
            targets |= {f"{mod}.{a.name}" for a in node.names}   # `from pkg import submodule`
    out = set()
    for t in targets:
        if t != PKG and not t.startswith(PKG + "."):
            continue
        parts = t.split(".")[1:]
        while parts and ".".join(parts) not in mods:   # a name inside a module: the module
            parts.pop()
        for i in range(len(parts) + 1):                # the packages above run first
            dep = ".".join(parts[:i])
            # the importer's own packages (the root among them) are running already
            own = dep == "" or name == dep or name.startswith(dep + ".")
            if dep in mods and not own:
                out.add(dep)
    return out


@functools.lru_cache(maxsize=1)   # read-only: every test reads the same graph
def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    # a package whose __init__ imports nothing of the package is only a folder: importing one
    # of its modules depends on that module alone
    folders = {n for n, p in mods.items() if p.name == "__init__.py" and not graph[n]}
    return {n: deps - folders for n, deps in graph.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict = {}
    low: dict = {}
    stack: list = []
    on: set = set()
    out = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def layer_of(name: str) -> int:
    best, rank = -1, None
    for i, (_, patterns) in enumerate(LAYERS):
        for p in patterns:
            hit = (name == p or (p and name.startswith(p + "."))
                   or ("*" in p and fnmatch.fnmatch(name.split(".")[0], p)))
            if hit and len(p) > best:
                best, rank = len(p), i
    if rank is None:
        raise AssertionError(f"module {PKG}.{name} is in no layer: add it to LAYERS in "
                             f"tests/test_layers.py")
    return rank


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, deps in graph.items() for b in deps
                  if layer_of(b) > layer_of(a))


def _show(mods) -> str:
    return ", ".join(f"{PKG}.{m}".rstrip(".") for m in sorted(mods))


def test_no_import_cycles():
    found = cycles(import_graph())
    new = [c for c in found if c not in ALLOWED_CYCLES]
    assert not new, "import cycles: " + "; ".join(_show(c) for c in new)
    gone = [c for c in ALLOWED_CYCLES if c not in found]
    assert not gone, ("no longer a cycle, delete its ALLOWED_CYCLES entry: "
                      + "; ".join(_show(c) for c in gone))


def test_layers_point_one_way():
    graph = import_graph()
    bad = upward(graph)
    new = [(a, b) for a, b in bad if (a, b) not in ALLOWED_UPWARD]
    names = [n for n, _ in LAYERS]
    assert not new, "imports from a layer above: " + "; ".join(
        f"{PKG}.{a} ({names[layer_of(a)]}) imports {PKG}.{b} ({names[layer_of(b)]})"
        for a, b in new)
    gone = [e for e in ALLOWED_UPWARD if e not in bad]
    assert not gone, f"no longer imported, delete its ALLOWED_UPWARD entry: {gone}"


def test_nothing_below_the_monitor_imports_it():
    graph = import_graph()
    top = layer_of("monitor")
    users = sorted(a for a, deps in graph.items() if "monitor" in deps and layer_of(a) <= top
                   and (a, "monitor") not in ALLOWED_UPWARD)
    assert not users, f"modules below the monitor import it: {users}"


def test_stats_imports_nothing_above_it():
    graph = import_graph()
    up = sorted((a, b) for a, deps in graph.items() if a.split(".")[0] == "stats"
                for b in deps if b.split(".")[0] not in ("stats", "formats"))
    assert not up, f"stats/ must sit at the bottom: {up}"


def test_the_monitor_writes_no_private_attribute_of_its_parts():
    # the monitor assembles parts through their public methods (a part's private state is the
    # part's own business): `self._x = ...` is fine, `self.buffer._x = ...` is not
    bad = []
    for node in (n for f in ("monitor.py", "handling.py")
                 for n in ast.walk(ast.parse((ROOT / f).read_text()))):
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            for a in ast.walk(t):
                if (isinstance(a, ast.Attribute) and a.attr.startswith("_")
                        and not a.attr.startswith("__")
                        and not (isinstance(a.value, ast.Name) and a.value.id == "self")):
                    bad.append(f"line {node.lineno}: {ast.unparse(t)}")
    assert not bad, f"the monitor writes private attributes of other objects: {bad}"


# the finder itself, on small graphs and sources
def test_cycles_finds_a_three_module_ring_and_ignores_a_dag():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


@pytest.mark.parametrize("src, want", [
    ("from .stats.layout import Stat", {"stats", "stats.layout"}),
    ("from . import monitor", {"monitor"}),
    ("def f():\n    from .monitor import Monitor", {"monitor"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .monitor import Monitor",
     set()),
    ("import stabilitywatch.stats.layout as L", {"stats", "stats.layout"}),
    ("import os, torch", set()),
], ids=["from-dotted", "from-package", "late-import", "type-checking", "absolute", "outside"])
def test_imports_are_read_from_the_source(tmp_path, src, want):
    p = tmp_path / "mod.py"
    p.write_text(src + "\n")
    mods = {"": ROOT / "__init__.py", "monitor": p, "stats": p, "stats.layout": p, "alert": p}
    assert _imports("alert", p, mods) == want
