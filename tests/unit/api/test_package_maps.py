"""Docstrings that name modules name modules that exist, and every package's docstring maps all
of its modules: ``recsys_dist/__init__.py``'s "Package map" listed ``spec``, ``sharding``,
``trainer``, ``export``, ... as flat modules long after they moved into packages, and
``serve/__init__.py`` named 3 of its 11 modules."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "recsys_dist"
# Folders of the repository a docstring may point into (``docs/api.md``, ``tests/...``).
REPO_FOLDERS = {"benchmarks", "configs", "datasets", "docs", "examples", "pipelines", "recsys_dist", "tests"}
# Packages whose modules are plug-ins listed elsewhere: the shipped models (the registry, docs/models.md).
UNMAPPED = {"recsys_dist.models.zoo"}
DOTTED = re.compile(r"\brecsys_dist(?:\.\w+)+")
PATH = re.compile(r"(?<![\w./-])((?:[\w.-]+/)+[\w.-]*)")


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PKG.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


MODULES = _modules()
TREES = {m: ast.parse(f.read_text()) for m, f in MODULES.items()}


def _docstrings():
    """(file, line, docstring) of every module, class and function of the package."""
    for m, tree in TREES.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                text = ast.get_docstring(node, clean=False)
                if text:
                    yield MODULES[m], getattr(node, "lineno", 1), text


def _names(module: str) -> set[str]:
    """What ``module.<name>`` can name: its top-level definitions and imports, and the names a
    package exports lazily (``__all__``; the root's ``_API``)."""
    names = set()
    for node in TREES[module].body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
            if any(getattr(t, "id", None) in ("__all__", "_API") for t in targets):
                names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _dotted_problem(ref: str) -> str | None:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in MODULES:
            rest = parts[i:]
            if rest and rest[0] not in _names(module):
                return f"{module} defines no {rest[0]}"
            return None
    return "no such module"


def test_every_module_and_name_a_docstring_gives_in_full_exists():
    """``recsys_dist.a.b`` and ``recsys_dist.a.b.name`` in a docstring: the module exists and
    defines (or imports, or lazily exports) the name."""
    bad = [
        f"{f.relative_to(ROOT)}:{line} {ref}: {problem}"
        for f, line, text in _docstrings()
        for ref in {r.rstrip(".") for r in DOTTED.findall(text)}
        if (problem := _dotted_problem(ref))
    ]
    assert not bad, "docstrings name modules or names that do not exist:\n" + "\n".join(sorted(bad))


def test_every_file_or_folder_a_docstring_points_to_exists():
    """A path in a docstring (``formats/``, ``convert/cache.py``, ``docs/api.md``, ...) exists,
    relative to the repository, the package or a package around the docstring's module. A path
    whose first part is none of these (``runs/``, ``RUN_DIR/...``, ``I/O``) is not checked."""
    bad = []
    for f, line, text in _docstrings():
        around = [p for p in [f.parent, *f.parent.parents] if p == PKG or PKG in p.parents]
        for ref in {r.rstrip(".") for r in PATH.findall(text)}:
            first = ref.split("/")[0]
            ours = first in REPO_FOLDERS or any((p / first).exists() for p in around)
            if not (ours and (ref.endswith(("/", ".py", ".md", ".yaml")) or first in REPO_FOLDERS)):
                continue
            if not any((base / ref).exists() for base in [ROOT, *around]):
                bad.append(f"{f.relative_to(ROOT)}:{line} {ref}")
    assert not bad, "docstrings point to files or folders that do not exist:\n" + "\n".join(sorted(bad))


def test_every_package_docstring_maps_each_of_its_modules():
    """A package's docstring names each of its modules and subpackages as ``name`` (or
    ``name/``, ``name.Something``): a map that leaves modules out reads as complete and is not."""
    missing = []
    for package, init in MODULES.items():
        if init.name != "__init__.py" or package in UNMAPPED:
            continue
        text = ast.get_docstring(TREES[package]) or ""
        named = {token.rstrip("/").split(".")[0] for token in re.findall(r"``([^`]+)``", text)}
        inside = [
            p.stem if p.suffix == ".py" else p.name
            for p in init.parent.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()
        ]
        missing += [f"{init.relative_to(ROOT)}: ``{name}``" for name in sorted(set(inside) - named)]
    assert not missing, "package docstrings that leave modules out:\n" + "\n".join(missing)
