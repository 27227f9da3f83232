"""The pages ``docs/conf.py`` generates at build time: the API reference and the notebooks.

Both are written into directories git ignores (``docs/api/``, ``docs/notebooks/``) from their single sources - the
packages' ``__all__`` and docstrings, the jupytext files under ``notebooks/`` - so the site cannot drift from them.
"""

from __future__ import annotations

import importlib
import shutil
import tomllib
import types
from pathlib import Path

# The public surface, in the order a reader meets it. Each entry: (module, one line on what it holds). Every name of
# the module's ``__all__`` gets a row; an object exported by several modules is documented once, under the first
# module in LAYERS that exports it, and linked from the others.
PUBLIC = [
    ("lcx", "The text-level API (`lcx.load`) and the names most code needs."),
    ("lcx.lm", "`lcx.load` and the `LM` it returns: text in, text out."),
    ("lcx.engine", "Compiled prefill / decode / score programs, the `Generator`, `generate`, sampling."),
    ("lcx.engine.server", "The serving loop: continuous batching over a paged cache."),
    ("lcx.service", "`lcx serve`: the OpenAI-compatible HTTP service over the serving loop."),
    ("lcx.cache", "KV caches, the cache contract, eviction policies and their registry."),
    ("lcx.kernels", "Attention kernels: the backend table, Pallas flash / split-K decode / paged decode, references."),
    ("lcx.model", "The functional Flax decoder and its parameters."),
    ("lcx.hf", "Hugging Face directories and GGUF files in and out."),
    ("lcx.parallel.sharding", "Device meshes and the logical-axis sharding rules."),
    ("lcx.parallel.context", "Context parallelism: the `seq` mesh axis, zig-zag layout, ring / all-gather attention."),
    ("lcx.data", "Tokenizers, synthetic and RULER-style tasks, corpora, packing, batches."),
    ("lcx.train", "Training: step, loop, checkpoints, warm starts."),
    ("lcx.eval", "Evaluation and ablation grids: prompts, grading, statistics, reports."),
    ("lcx.plan", "The planner: memory, topology and precision checks of a deployment."),
]
# Types that public signatures name but no package exports: documented under their own modules' names, so a
# signature's annotation links to them (and the nitpicky build finds every lcx type it mentions).
SIGNATURE_TYPES = ["lcx.model.config.AttentionSpec", "lcx.model.families.Family", "lcx.cache.paged.PagedState",
                   "lcx.cache.page_pool.PagePool", "lcx.cache.reconstruct.Reconstruction", "lcx.eval.config.Setting",
                   "lcx.eval.config.PerplexityConfig", "lcx.eval.config.SpeculativeEvalConfig", "lcx.eval.cells.Shard",
                   "lcx.cache.storage.base.KVStorage"]
# Lower layers first: an object lives where its layer exports it (``lcx.CacheConfig`` is ``lcx.cache.CacheConfig``).
LAYERS = ["lcx.kernels", "lcx.model", "lcx.parallel.sharding", "lcx.parallel.context", "lcx.cache", "lcx.engine",
          "lcx.engine.server", "lcx.hf", "lcx.lm", "lcx.data", "lcx.train", "lcx.eval", "lcx.plan", "lcx.service",
          "lcx"]


def version(root: Path) -> str:
    return tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]


def exports(module: str) -> list[tuple[str, object]]:
    mod = importlib.import_module(module)
    names = getattr(mod, "__all__", None)
    if names is None:
        raise ValueError(f"docs: {module} has no __all__; the API reference lists a module's __all__")
    return [(name, getattr(mod, name)) for name in names]


def documented(obj) -> bool:
    """Whether ``obj`` gets a page of its own: classes, functions and modules (a module links to its section)."""
    return isinstance(obj, (type, types.ModuleType)) or callable(obj)


def homes() -> dict[int, str]:
    """id(object) -> the module whose page documents it (the lowest layer exporting it)."""
    home: dict[int, str] = {}
    for module in LAYERS:
        for _, obj in exports(module):
            if documented(obj) and not isinstance(obj, types.ModuleType):
                home.setdefault(id(obj), module)
    return home


def api_page() -> str:
    home = homes()
    modules = {m for m, _ in PUBLIC}
    lines = ["# API reference", "",
             "Every public name of lcx, package by package: click a name for its signature and docstring. An object "
             "that several packages export is documented once, where its layer defines it, and linked from the "
             "others. Generated from each package's `__all__` at build time (`docs/build_pages.py`).", ""]
    for module, summary in PUBLIC:
        own, elsewhere, constants = [], [], []
        for name, obj in exports(module):
            if not documented(obj):
                # A constant's "docstring" would be its type's (dict's, tuple's): named with its type instead.
                constants.append(f"`{name}` ({type(obj).__name__})")
            elif isinstance(obj, types.ModuleType):
                target = obj.__name__ if obj.__name__ in modules else None
                elsewhere.append(f"{{py:mod}}`{name} <{target}>`" if target else f"`{name}`")
            elif home[id(obj)] == module:
                own.append(name)
            else:
                elsewhere.append(f"{{py:obj}}`{name} <{home[id(obj)]}.{name}>`")
        lines += [f"## `{module}`", "", summary, "", "```{eval-rst}", f".. automodule:: {module}", "   :no-members:",
                  "", f".. currentmodule:: {module}", ""]
        if own:
            lines += [".. autosummary::", "   :toctree: generated", "   :nosignatures:", ""]
            lines += [f"   {name}" for name in own] + [""]
        lines += ["```", ""]
        if elsewhere:
            lines += ["Also exported here: " + ", ".join(elsewhere) + ".", ""]
        if constants:
            lines += ["Constants (documented in the source): " + ", ".join(constants) + ".", ""]
    lines += ["## Types in signatures", "", "Types the signatures above name that no package exports.", ""]
    for path in SIGNATURE_TYPES:
        module, name = path.rsplit(".", 1)
        lines += ["```{eval-rst}", f".. currentmodule:: {module}", "", ".. autosummary::", "   :toctree: generated",
                  "   :nosignatures:", "", f"   {name}", "```", ""]
    return "\n".join(lines)


def notebook_pages(root: Path) -> dict[str, str]:
    """name -> Markdown of every jupytext notebook (text cells as text, code cells as code blocks), plus the index."""
    import jupytext

    pages = {}
    sources = sorted((root / "notebooks").glob("[0-9][0-9]_*.py"))
    for path in sources:
        nb = jupytext.reads(path.read_text(), fmt="py:percent")
        nb.metadata = {}
        body = jupytext.writes(nb, fmt="md")
        pages[path.stem] = (f"{body}\n\n---\n\nSource: `notebooks/{path.name}` (jupytext; rendered here, not "
                            f"executed). Run it: `cd notebooks && python {path.name}`, or open it in Jupyter.\n")
    readme = (root / "notebooks" / "README.md").read_text()
    toc = "\n".join(["", "```{toctree}", ":maxdepth: 1", ""] + [p.stem for p in sources] + ["```", ""])
    pages["index"] = readme + toc
    return pages


def _write(path: Path, text: str) -> None:
    # Rewriting an unchanged page would make Sphinx rebuild it (and everything linking to it) on every build.
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def write_all(root: Path, docs: Path) -> None:
    # autosummary writes one stub per listed object and never deletes one: a name that left an __all__ would keep
    # a page outside every toctree (a -W failure). Stubs are cheap to regenerate.
    shutil.rmtree(docs / "api" / "generated", ignore_errors=True)
    _write(docs / "api" / "index.md", api_page())
    for name, text in notebook_pages(root).items():
        _write(docs / "notebooks" / f"{name}.md", text)


__all__ = ["PUBLIC", "LAYERS", "SIGNATURE_TYPES", "api_page", "documented", "exports", "homes", "notebook_pages",
           "version", "write_all"]
