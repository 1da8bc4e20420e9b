"""The package's layers: who may import whom, and the size limits that keep modules readable.

Layers, lowest first; a module imports only modules of its own layer or of lower ones, counting
every import (function-level ones and ``if TYPE_CHECKING:`` ones too):

    base       errors, faults, logs, versions, files, section (the strict section base)
    sections   each component's config section (``<package>/config.py``, and ``data/split_config.py``): pydantic and base only
    data       data/
    models     models/
    distributed
    checkpoint (under train: the Trainer saves and resumes)
    train      (train/job.py: the resolved Job every component below the CLI receives)
    serve
    run        config.run, config.loader, config.reference, config.job: the root RunConfig and its
               resolution into a Job; above every component, so none can take the root config
    cli
    api        the package root (lazy public names), api (the public Trainer and resolve_job over
               a RunConfig) and testing (run_ranks for users' tests)
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "recsys_dist"

LAYERS = ["base", "sections", "data", "models", "distributed", "checkpoint", "train", "serve", "run", "cli", "api"]
BASE = {
    "recsys_dist.errors",
    "recsys_dist.faults",
    "recsys_dist.logs",
    "recsys_dist.versions",
    "recsys_dist.files",
    "recsys_dist.section",
}
SECTIONS = {f"recsys_dist.{p}.config" for p in ("data", "models", "distributed", "train", "checkpoint")}
# data.split, the data section's part of its own module (data/config.py is at the size limit)
SECTIONS.add("recsys_dist.data.split_config")
MAX_FUNCTION_LEVEL = 10
MAX_ROOT_MODULES = 10
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def layer(module: str) -> str:
    if module in BASE:
        return "base"
    if module in SECTIONS:
        return "sections"
    if module in ("recsys_dist", "recsys_dist.testing", "recsys_dist.api"):
        return "api"
    first = module.split(".")[1]
    if first == "config":
        return "run"
    assert first in LAYERS, f"{module}: no layer for package {first!r}; add it to LAYERS"
    return first


def _imports(mods: dict[str, Path]):
    """(module, line, imported module, at top level) for every import of a recsys_dist module."""
    for name, f in mods.items():
        tree = ast.parse(f.read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom):
                names += [f"{node.module}.{a.name}" for a in node.names]
            found = set()
            for n in names:
                while n and n not in mods:
                    n = n.rpartition(".")[0]
                if n:
                    found.add(n)
            # a module importing its own parent package is not an edge to that package's __init__
            for dep in sorted(found - {name}):
                if not name.startswith(dep + "."):
                    yield name, node.lineno, dep, id(node) in top


def test_every_import_goes_down_the_layers():
    mods = _modules()
    up = [
        f"{mods[m].relative_to(ROOT)}:{line} ({layer(m)}) imports {dep} ({layer(dep)})"
        for m, line, dep, _ in _imports(mods)
        if LAYERS.index(layer(dep)) > LAYERS.index(layer(m))
    ]
    assert not up, "imports up the layers:\n" + "\n".join(up)


def test_no_import_cycle_counting_function_level_imports_and_package_inits():
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, _, dep, _ in _imports(mods):
        edges[m].add(dep)
    state: dict[str, int] = {}
    cycles = []

    def visit(v, path):
        state[v] = 1
        for w in sorted(edges[v]):
            if state.get(w) == 1:
                cycles.append(path[path.index(w) :] + [w])
            elif w not in state:
                visit(w, path + [w])
        state[v] = 2

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in state:
            visit(v, [v])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_section_configs_import_only_pydantic_and_base():
    allowed_third_party = {"pydantic", "annotated_types", "typing_extensions"}
    bad = []
    for m, f in _modules().items():
        if m not in SECTIONS:
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                roots = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                roots = [(node.module or "").split(".")[0]]
            else:
                continue
            for r in roots:
                if r == "recsys_dist" or r in allowed_third_party or r in sys.stdlib_module_names:
                    continue
                bad.append(f"{f.relative_to(ROOT)}:{node.lineno} imports {r}")
    assert not bad, "section configs must stay torch-free:\n" + "\n".join(bad)


def test_few_function_level_imports_each_with_a_reason():
    mods = _modules()
    lazy = [(m, line) for m, line, _, top in _imports(mods) if not top]
    unexplained = []
    for m, line in lazy:
        lines = mods[m].read_text().splitlines()
        here, above = lines[line - 1], lines[line - 2] if line > 1 else ""
        if "#" not in here and not above.strip().startswith("#"):
            unexplained.append(f"{mods[m].relative_to(ROOT)}:{line}")
    where = sorted({f"{mods[m].relative_to(ROOT)}:{line}" for m, line in lazy})
    assert len(where) <= MAX_FUNCTION_LEVEL, f"{len(where)} function-level imports:\n" + "\n".join(where)
    assert not unexplained, "function-level imports without a one-line reason:\n" + "\n".join(unexplained)


def test_module_and_function_sizes():
    root = [f.name for f in PKG.glob("*.py")]
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {sorted(root)}"
    big, long = [], []
    for f in PKG.rglob("*.py"):
        text = f.read_text()
        lines = text.splitlines()
        if len(lines) > MAX_MODULE_LINES:
            big.append(f"{f.relative_to(ROOT)}: {len(lines)} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                reason = lines[first - 2].strip() if first > 1 else ""
                if n > MAX_FUNCTION_LINES and not reason.startswith("# long:"):
                    long.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not big, "modules over the limit:\n" + "\n".join(big)
    assert not long, "functions over the limit (or say why in a '# long: ...' comment above):\n" + "\n".join(long)


def test_every_module_imports():
    """Each module imports on its own (a name moved to another module breaks no importer)."""
    import importlib

    for name in sorted(_modules()):
        importlib.import_module(name)


def test_no_component_takes_the_root_config():
    """Below the run layer a function takes its own section (typed) or the resolved Job, never
    an untyped ``cfg`` that could be the root config, and nothing re-derives a section from one
    (``getattr(cfg, "data", cfg)``) or reads ``job.cfg``."""
    mods = _modules()
    run = LAYERS.index("run")
    found = []
    for name, f in mods.items():
        if LAYERS.index(layer(name)) >= run:
            continue
        text = f.read_text()
        for bad in ('getattr(cfg, "data"', "job.cfg", "Job | RunConfig"):
            if bad in text:
                found.append(f"{f.relative_to(ROOT)}: {bad}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                found += [
                    f"{f.relative_to(ROOT)}:{node.lineno} {node.name}({a.arg}) has no type"
                    for a in args
                    if a.arg == "cfg" and a.annotation is None
                ]
    assert not found, "the root config below the run layer:\n" + "\n".join(found)


# Folders in layer order (the package root's modules are the base layer).
FOLDERS = ["", "data", "models", "distributed", "checkpoint", "train", "serve", "config", "cli", "api"]
# The arrows that run back up the folders, each with its reason in docs/architecture.md.
ALLOWED_UP = {("models", "train")}


def test_at_most_two_folder_arrows_run_back_up_each_documented():
    """Read at folder level, imports run down too, but for those listed in ``ALLOWED_UP`` (at most
    2), each named with its reason in docs/architecture.md "Arrows that run back up"."""
    mods = _modules()

    def folder(m: str) -> str:
        if layer(m) == "api":  # the package root's public modules sit above every folder
            return "api"
        parts = m.split(".")
        return parts[1] if len(parts) > 2 or mods[m].name == "__init__.py" else ""

    up = set()
    for m, _, dep, _ in _imports(mods):
        a, b = folder(m), folder(dep)
        if a in FOLDERS and b in FOLDERS and FOLDERS.index(b) > FOLDERS.index(a):
            up.add((a, b))
    assert up <= ALLOWED_UP and len(ALLOWED_UP) <= 2, f"folder arrows back up: {sorted(up)}"
    doc = (ROOT / "docs" / "architecture.md").read_text()
    for a, b in ALLOWED_UP:
        assert f"`{a}/" in doc and f"`{b}/" in doc, (a, b)
