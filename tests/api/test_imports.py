"""The package's import graph: no cycles, and no module imports another's private names."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "recsys_dist"


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _imported(node, mods) -> set[str]:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    if isinstance(node, ast.ImportFrom):
        names += [f"{node.module}.{a.name}" for a in node.names]
    out = set()
    for n in names:
        while n and n not in mods:
            n = n.rpartition(".")[0]
        if n:
            out.add(n)
    return out


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (imports for annotations
    only, never executed: they cannot make an import cycle)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
                stack.extend(child.orelse)
            else:
                stack.append(child)


def test_no_import_cycle_in_the_package():
    mods = _modules()
    edges = {}
    for name, f in mods.items():
        deps = set()
        for node in _runtime_nodes(ast.parse(f.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and not getattr(node, "level", 0):
                deps |= _imported(node, mods)
        # a package's __init__ importing its own submodules is not a cycle
        edges[name] = {d for d in deps if d != name and not (f.name == "__init__.py" and d.startswith(name + "."))}
    state: dict[str, int] = {}
    cycles = []

    def visit(v, path):
        state[v] = 1
        for w in edges[v]:
            if state.get(w) == 1:
                cycles.append(path[path.index(w) :] + [w])
            elif w not in state:
                visit(w, path + [w])
        state[v] = 2

    for v in sorted(edges):
        if v not in state:
            visit(v, [v])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_nothing_imports_a_private_name_from_another_module():
    found = []
    for folder in ("recsys_dist", "benchmarks", "tests", "examples", "pipelines"):
        for f in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("recsys_dist"):
                    private = [a.name for a in node.names if a.name.startswith("_") and a.name != "__version__"]
                    if private or any(p.startswith("_") for p in node.module.split(".")):
                        found.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.module} {private}")
                elif isinstance(node, ast.Import):
                    found += [
                        f"{f.relative_to(ROOT)}:{node.lineno} {a.name}"
                        for a in node.names
                        if a.name.startswith("recsys_dist") and any(p.startswith("_") for p in a.name.split("."))
                    ]
    assert not found, "private names imported across modules:\n" + "\n".join(found)


def test_public_api_is_complete_and_documented():
    import recsys_dist

    missing = []
    for name in recsys_dist.__all__:
        if name == "__version__":
            continue
        obj = getattr(recsys_dist, name)
        if not (obj.__doc__ or "").strip():
            missing.append(name)
    assert not missing, f"public names without a docstring: {missing}"
    want = {"load_config", "RunConfig", "Trainer", "FeatureSpec", "shard", "register_model", "register_loss"}
    want |= {"ParquetBatchLoader", "binary_metrics", "save_checkpoint", "load_checkpoint", "launch"}
    assert want <= set(recsys_dist.__all__)
    assert (ROOT / "recsys_dist" / "py.typed").is_file()
