"""No module imports another's private names; the public API is complete and documented.
(The import graph itself: tests/unit/api/test_layers.py.)"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "recsys_dist"


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


def test_user_errors_are_defined_once_in_errors():
    """The errors printed as one line are one tuple, ``recsys_dist.errors.USER_ERRORS``: the
    command line and a rank once kept a copy each, which could drift apart."""
    defined = [
        f"{f.relative_to(ROOT)}:{node.lineno}"
        for f in PKG.rglob("*.py")
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "USER_ERRORS" for t in node.targets)
    ]
    assert len(defined) == 1 and defined[0].startswith("recsys_dist/errors.py:"), defined
