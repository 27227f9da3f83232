"""The layers of lcx import downwards only: no module imports one that (directly or around a loop) imports it.

The graph is read from the source: every ``import`` statement (function-level ones and those under ``if
TYPE_CHECKING:`` included - a type one module names from another is a dependency even when it is never imported at
run time) and every ``importlib.import_module("lcx....")`` of a string constant (an import by another name). A module
importing its own package's ``__init__`` is a re-export, not an edge. Cycles are the strongly connected components
with more than one module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lcx"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(f.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def _is_import_module(node: ast.AST) -> bool:
    """``importlib.import_module("...")`` or ``import_module("...")`` with a string constant."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)):
        return False
    fn = node.func
    return (isinstance(fn, ast.Attribute) and fn.attr == "import_module") or (
        isinstance(fn, ast.Name) and fn.id == "import_module")


def import_targets(tree: ast.AST, package: str) -> set[str]:
    """The dotted names a module's source imports: import statements anywhere (under ``if TYPE_CHECKING:`` too) and
    string targets of ``importlib.import_module``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
        elif _is_import_module(node):
            out.add(node.args[0].value)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        package = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for t in import_targets(ast.parse(f.read_text()), package):
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != m and not (mods[t].name == "__init__.py" and m.startswith(t + ".")):
                edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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


def test_import_graph_has_no_cycles():
    assert cycles(import_graph()) == []


def test_import_graph_detects_a_cycle():
    # The check can fail: a two-module loop and a three-module loop are both found.
    edges = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(cycles(edges)) == [["a", "b"], ["c", "d", "e"]]


def test_import_graph_sees_typing_and_importlib_edges():
    # An import under ``if TYPE_CHECKING:`` (at module level or in a function) and a string target of
    # ``importlib.import_module`` are edges, so loops made of them are found too.
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from lcx.model.config import ModelConfig
def load(path):
    import importlib
    return importlib.import_module("lcx.checkpoints.gguf").load_gguf(path)
def other():
    from importlib import import_module
    if TYPE_CHECKING:
        from . import sharding
    return import_module("lcx.cache.base")
def plugin(name):
    import importlib
    return importlib.import_module(name)  # not a constant: no edge
"""
    targets = import_targets(ast.parse(source), "lcx.parallel")
    for t in ("lcx.model.config", "lcx.model.config.ModelConfig", "lcx.checkpoints.gguf", "lcx.cache.base",
              "lcx.parallel.sharding"):
        assert t in targets, (t, targets)
    edges = {"lcx.parallel.sharding": {"lcx.config"}, "lcx.config": {"lcx.cache.config"},
             "lcx.cache.config": {"lcx.cache.base"}, "lcx.cache.base": {"lcx.parallel.sharding"}}
    # the circle issue 61 broke: the mesh rules named the root config's ModelConfig under TYPE_CHECKING
    assert cycles(edges) == [["lcx.cache.base", "lcx.cache.config", "lcx.config", "lcx.parallel.sharding"]]
    assert "lcx.parallel.sharding -> lcx.config: parallel imports only" in " | ".join(floor_violations(edges))


def test_import_graph_ground_floor_imports_nothing_from_lcx():
    edges = import_graph()
    assert edges["lcx.config_base"] == set()
    # The kernels know nothing of models, caches or configs beyond the plumbing.
    for module, targets in edges.items():
        if module.startswith("lcx.kernels"):
            assert all(t.startswith("lcx.kernels") or t == "lcx.config_base" for t in targets), (module, targets)


# The floors of the package layout (docs/architecture.md): each package imports only from its own floor and below.
BELOW_ENGINE = ("lcx.kernels", "lcx.parallel", "lcx.model", "lcx.cache")
ABOVE_ENGINE = ("lcx.checkpoints", "lcx.data", "lcx.train", "lcx.eval", "lcx.plan", "lcx.cli", "lcx.experiment",
                "lcx.lm", "lcx.service")
CONFIG_MODULES = ("lcx.config", "lcx.model.config", "lcx.cache.config", "lcx.train.config", "lcx.eval.config")


def _in(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def floor_violations(edges: dict[str, set[str]]) -> list[str]:
    broken = []
    for module, targets in edges.items():
        for t in sorted(targets):
            if _in(module, ["lcx.parallel"]) and not _in(t, ["lcx.kernels", "lcx.parallel", "lcx.config_base"]):
                broken.append(f"{module} -> {t}: parallel imports only kernels and config plumbing")
            if _in(module, BELOW_ENGINE) and _in(t, ("lcx.engine", *ABOVE_ENGINE)):
                broken.append(f"{module} -> {t}: nothing below the engine imports it or what sits above it")
            if _in(module, ["lcx.engine"]) and _in(t, ABOVE_ENGINE):
                broken.append(f"{module} -> {t}: the engine imports no checkpoint, data, training or CLI code")
            if module in CONFIG_MODULES and _in(t, ["lcx.kernels", "lcx.parallel"]) and not t.endswith(".names"):
                broken.append(f"{module} -> {t}: a config module checks names (lcx.*.names), imports no kernel "
                              "or parallel code")
    return broken


def test_import_graph_floor_rules():
    assert floor_violations(import_graph()) == []


def test_import_graph_floor_rules_can_fail():
    # a parallel module importing the model, a cache importing the engine, and a config importing context
    # parallelism are each reported
    edges = {m: set(t) for m, t in import_graph().items()}
    edges["lcx.parallel.sharding"].add("lcx.model.config")
    edges["lcx.cache.paged"].add("lcx.engine.server")
    edges["lcx.model.config"].add("lcx.parallel.context")
    found = " | ".join(floor_violations(edges))
    for edge in ("lcx.parallel.sharding -> lcx.model.config", "lcx.cache.paged -> lcx.engine.server",
                 "lcx.model.config -> lcx.parallel.context"):
        assert edge in found


MAX_LINES = 450
SERVER_LINES = 250  # the serving core's composition (lcx/engine/server.py): its parts live beside it


def test_package_layout_limits():
    """At most 8 modules loose in lcx/ beside the packages, no module over 450 lines (split along seams), and the
    server a thin composition of its Scheduler, PrefixCache and Runner."""
    loose = sorted(f.name for f in ROOT.glob("*.py"))
    assert len(loose) <= 8, loose
    lines = {f.relative_to(ROOT).as_posix(): len(f.read_text().splitlines()) for f in ROOT.rglob("*.py")}
    long = {f: n for f, n in lines.items() if n > MAX_LINES}
    assert long == {}
    assert lines["engine/server.py"] <= SERVER_LINES


# A branch on the KV storage type: a condition that reads a storage flag, a quantized-dtype table or a format name.
# Kinds, slot attention, CacheConfig and the serving core ask their ``KVStorage`` (lcx/cache/storage/) instead.
STORAGE_BRANCH = re.compile(
    r"(\bif\b|\belif\b|\bwhile\b).*(\blowbit\b|\.lowbit\b|LOWBIT|QUANT_DTYPES|KV_DTYPES|\.quant\b|\bquant is|"
    r"working_quant|store_dtype|\.quantized|\.bits is|k_scale is|kv_dtype (not )?in|(kv_dtype|name|dtype) (not )?in "
    r"FORMATS)")
MAX_STORAGE_BRANCHING = 5


def storage_branching(sources: dict[str, str]) -> list[str]:
    """The modules outside lcx/kernels/ (whose kernels take codes and scales explicitly) that branch on the storage
    type."""
    return sorted(m for m, text in sources.items() if not m.startswith("kernels/")
                  and any(STORAGE_BRANCH.search(line) for line in text.splitlines()))


def test_few_modules_branch_on_the_storage_type():
    sources = {f.relative_to(ROOT).as_posix(): f.read_text() for f in ROOT.rglob("*.py")}
    branching = storage_branching(sources)
    assert len(branching) <= MAX_STORAGE_BRANCHING, branching
    # the check can fail: a kind asking a flag again is found
    assert "cache/kv_cache.py" in storage_branching({"cache/kv_cache.py": "        if self.lowbit:\n"})
