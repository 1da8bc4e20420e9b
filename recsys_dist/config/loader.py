"""Loading a run config: YAML (1.2 numbers, no duplicate keys), dotted overrides, migration
of renamed keys, and one error message listing every problem.

Relative paths written in a YAML file are resolved against the directory of that file;
relative paths given as command-line overrides are resolved against the current working
directory.

Example::

    cfg = load_config("configs/criteo_quickstart.yaml", ["train.batch_size=64"])
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from recsys_dist.config.run import RunConfig
from recsys_dist.data.config import missing_data_files
from recsys_dist.files import write_atomic
from recsys_dist.models.registry import model_config_class
from recsys_dist.section import IMPORT_USER_CODE, ConfigError, format_validation_errors

# Config keys holding filesystem paths; resolved against the config file's directory.
PATH_KEYS = (
    "data.raw_path",
    "data.stream.path",
    "data.cache_dir",
    "data.split.validation_path",
    "data.split.test_path",
)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _get_dotted(tree: dict, key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _resolve_paths(tree: dict, base: Path, keys: tuple[str, ...] = PATH_KEYS) -> None:
    def resolve(value):
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
            return str((base / value).resolve())
        return value

    for key in keys:
        value = _get_dotted(tree, key)
        if isinstance(value, list):
            _set_dotted(tree, key, [resolve(v) for v in value])
        elif isinstance(value, str):
            _set_dotted(tree, key, resolve(value))


class _YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2's numbers and no duplicate keys.

    YAML 1.1 (PyYAML's default) reads ``1e-3`` as a string, ``010`` as 8 (octal), ``1:04``
    as 64 (base 60) and ``0b11`` as 3; here a number is decimal: ``[-+]digits`` is an int,
    with a fraction and/or an exponent (``1.5``, ``.5``, ``1e-3``, ``.5e3``) a float, ``_``
    allowed between digits. A key given twice in one mapping is an error (YAML 1.1 keeps the
    last silently); merge keys (``<<: *defaults``) still work, and their keys may be
    overridden.
    """


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_INT_TAG, re.compile(r"^[-+]?[0-9][0-9_]*$"), list("-+0123456789"))
_YamlLoader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _decimal_int(loader: _YamlLoader, node: yaml.ScalarNode) -> int:
    return int(loader.construct_scalar(node).replace("_", ""), 10)


_YamlLoader.add_constructor(_INT_TAG, _decimal_int)


def _mapping_without_duplicates(loader: _YamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # "<<": its keys are defaults the mapping's own keys may override
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"line {key_node.start_mark.line + 1}: a key must be a plain name, not a list or mapping",
                key_node.start_mark,
            )
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} on line {key_node.start_mark.line + 1} is given twice (also on line "
                f"{seen[key] + 1}); keep one",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def yaml_load(text: str):
    """Parse YAML text with the strict loader (YAML 1.2 numbers, no duplicate keys)."""
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


class _Replace(dict):
    """A mapping given whole on the command line (``model.args={}``, ``x={a: 1}``): it replaces
    the file's mapping at that key instead of being merged into it."""


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ``["a.b=1", "c=[1,2]"]`` into a nested dict; values are parsed as YAML.

    A mapping value (``model.args={}``, ``train.early_stopping={metric: auc}``) replaces the
    file's mapping at that key when merged by :func:`load_config`; dotted keys
    (``model.args.hidden=8``) change one entry and keep the rest."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override '{item}': expected dotted.key=value, e.g. train.batch_size=256")
        try:
            value = yaml_load(raw)
        except yaml.constructor.ConstructorError as err:  # parsed, but a key twice or a list as a key
            raise ConfigError(f"override '{item}': {err.problem}") from None
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override '{item}': the value is not valid YAML ({getattr(err, 'problem', err)}); "
                f"if it is text, quote it, e.g. {key}='\"{raw}\"'"
            ) from None
        _set_dotted(tree, key.strip(), _Replace(value) if isinstance(value, dict) else value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, _Replace):
            out[key] = _plain(value)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(
    tree: dict, source: str = "<dict>", overridden: frozenset = frozenset(), *, import_user_code: bool = True
) -> RunConfig:
    """Validate a nested dict into a :class:`RunConfig`; raises :class:`ConfigError`.
    ``overridden``: dotted keys set by command-line overrides, named as such in errors;
    ``import_user_code``: see :func:`load_config`."""
    try:
        return RunConfig.model_validate(tree, context={IMPORT_USER_CODE: import_user_code})
    except ValidationError as err:
        raise ConfigError(format_validation_errors(err, source, overridden)) from None


def load_config(
    path: str | os.PathLike,
    overrides: list[str] | None = None,
    *,
    check_files: bool = True,
    import_user_code: bool = True,
) -> RunConfig:
    """Load a YAML run config, apply dotted ``key=value`` overrides and validate it.

    Args:
        path: YAML file. Loaded with a ``yaml.SafeLoader`` (no object construction) that reads
            ``1e-3`` as a number and refuses a key given twice.
        overrides: e.g. ``["train.batch_size=64", "sharding.sharding_types=[row_wise]"]``.
        check_files: the data files the config names (``data.raw_path``,
            ``data.split.validation_path`` / ``test_path``) must exist, as ``recsys-dist
            train`` requires; False for a config only planned (``recsys-dist plan``), whose
            data may live elsewhere. An unset ``data.raw_path`` is not checked here.
        import_user_code: import the modules that ``model.name`` / ``train.loss`` name by
            import path to check them (the factory's ``model.args``, the loss's arguments);
            False for a command that never builds the model (``recsys-dist preprocess``): those
            keys are then checked by the command that trains.

    Raises:
        ConfigError: the file is missing or not a mapping, or any key is unknown,
            mistyped or out of range (every problem listed in one message); or a data file
            it names does not exist (naming the key and the file).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} {'is a directory' if path.is_dir() else 'does not exist'}")
    try:
        tree = yaml_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.start}); is it the right file?") from None
    if tree is None:  # an empty file: every required key is reported missing below
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (data:, model:, ...), "
            f"got {type(tree).__name__} {tree!r:.40}"
        )
    _resolve_paths(tree, path.resolve().parent)
    extra = parse_overrides(overrides or [])
    _resolve_paths(extra, Path.cwd())
    keys = frozenset(o.partition("=")[0].strip() for o in overrides or [])
    tree = _switch_model(tree, extra.get("model"))
    cfg = config_from_dict(_merge(tree, extra), str(path), keys, import_user_code=import_user_code)
    if check_files:
        problems = missing_data_files(cfg.data)
        if problems:
            raise ConfigError(f"invalid config {path}:\n" + "\n".join(f"  {p}" for p in problems))
    return cfg


def _switch_model(tree: dict, override: Any) -> dict:
    """When an override picks another ``model.name``, the file's options of the old model that
    the new one does not take are left out, with a warning naming them (options given on the
    command line are still checked strictly)."""
    model = tree.get("model")
    if not isinstance(override, dict) or not isinstance(model, dict) or "name" not in override:
        return tree
    if override["name"] == model.get("name", "dlrm"):
        return tree

    try:
        fields = model_config_class(override["name"]).model_fields
    except ValueError:
        return tree  # the unknown name is reported by validation
    dropped = sorted(k for k in model if k not in fields and k not in override)
    if dropped:
        warnings.warn(
            f"model.name={override['name']} on the command line: the file's model options "
            f"{', '.join(dropped)} belong to {model.get('name', 'dlrm')} and are left out",
            UserWarning,
            stacklevel=3,
        )
    return {**tree, "model": {k: v for k, v in model.items() if k not in dropped}}


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config (absolute paths, every default filled in) as YAML, atomically
    (a symbolic link at ``path`` is replaced, never written through: ``recsys_dist.files``)."""
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
