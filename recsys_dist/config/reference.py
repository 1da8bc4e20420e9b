"""``docs/config.md``: every config key with its type, default and description, from the schema.

The reference is derived from the pydantic sections (``model_fields``: annotations, constraints,
defaults, ``Field(description=...)``), so it cannot drift from the code; ``tests/
test_config_reference.py`` fails when the file in ``docs/`` differs from :func:`config_reference`.
Regenerate with::

    python -m recsys_dist.config.reference > docs/config.md
"""

from __future__ import annotations

import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from recsys_dist.config.run import RunConfig
from recsys_dist.models.config import ModelConfig
from recsys_dist.models.registry import FactoryModelConfig, get_model, model_names

REGENERATE = "python -m recsys_dist.config.reference > docs/config.md"

# What stands for the user's key in a section that is a mapping (``sharding.per_table.t_C1``).
_PLACEHOLDERS = {"sharding.per_table": "<table>", "sharding.fixed_plan": "<table>"}
_IMPORT_PATH = "package.module:factory"
_BOUNDS = ((at.Gt, "gt", ">"), (at.Ge, "ge", ">="), (at.Lt, "lt", "<"), (at.Le, "le", "<="))


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _strip(tp: Any) -> Any:
    """``tp`` without ``Annotated[...]`` (strictness markers, ``SerializeAsAny``)."""
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _members(tp: Any) -> tuple:
    tp = _strip(tp)
    return get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)


def _nested(tp: Any) -> tuple[type[BaseModel], bool] | None:
    """(section class, is a mapping of them) when a field holds a section or a dict of sections."""
    for member in _members(tp):
        member = _strip(member)
        if _is_section(member):
            return member, False
        if get_origin(member) is dict and _is_section(_strip(get_args(member)[1])):
            return _strip(get_args(member)[1]), True
    return None


def _type_name(tp: Any) -> str:
    """A readable type: ``int | null``, ``sum | mean``, ``list[int]``, ``[float, float]``."""
    tp = _strip(tp)
    origin, args = get_origin(tp), get_args(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin is dict:
        return f"dict[{_type_name(args[0])}, {_type_name(args[1])}]"
    if _is_section(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _bounds(field: FieldInfo) -> list[str]:
    """The field's numeric bounds and length limits, e.g. ``["> 0", "<= 16777216"]``."""
    out, lengths = [], [None, None]
    for item in field.metadata:
        for cls, attr, sign in _BOUNDS:
            if isinstance(item, cls):
                out.append(f"{sign} {getattr(item, attr)}")
        if isinstance(item, at.MinLen) and item.min_length:
            lengths[0] = item.min_length
        if isinstance(item, at.MaxLen):
            lengths[1] = item.max_length
    low, high = lengths
    if low is not None and low == high:
        out.append(f"length {low}")
    else:
        out += [f"length >= {low}"] * (low is not None) + [f"length <= {high}"] * (high is not None)
    return out


def _value(v: Any) -> str:
    """A default as it would be written in YAML."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _code(text: str) -> str:
    """Inline code inside a table cell (GitHub reads ``\\|`` in a cell as ``|``, code included)."""
    return "`" + text.replace("|", "\\|") + "`"


def _prose(text: str) -> str:
    """Description text for a table cell: pipes escaped, ``<feature>`` kept from reading as HTML."""
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return text.replace("|", "\\|").replace("<", "\\<")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading (lower case, punctuation dropped, spaces to hyphens)."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _heading(level: int, key: str) -> str:
    return f"{'#' * level} `{key}`"


def _link(key: str) -> str:
    return f"[`{key}`](#{slug(key)})"


def _doc(cls: type) -> str:
    """The first paragraph of a class's own docstring, as Markdown (empty when it has none)."""
    doc = cls.__dict__.get("__doc__") or ""
    para = doc.strip().split("\n\n")[0]
    return re.sub(r"``([^`]+)``", r"`\1`", " ".join(line.strip() for line in para.splitlines()))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, BaseModel):
        return "its defaults"
    return _code(_value(value))


def _rows(cls: type[BaseModel], prefix: str, fields: list[str], children: dict[str, str]) -> list[str]:
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name in fields:
        field = cls.model_fields[name]
        key = field.alias or name
        if not field.description:
            raise ValueError(f"{prefix}.{key} ({cls.__name__}.{name}) has no Field(description=...)")
        nested = _nested(field.annotation)
        kind = _code(_type_name(field.annotation))
        bounds = _bounds(field)
        if bounds:
            kind += " (" + ", ".join(bounds) + ")"
        text = _prose(field.description)
        if nested:
            text += f" Keys: {_link(children[key])}."
        rows.append(f"| {_code(key)} | {kind} | {_default(field)} | {text} |")
    return rows


def _section(level: int, key: str, cls: type[BaseModel], fields: list[str] | None = None, intro: str = "") -> list:
    """[(level, key, markdown)] for this section and, after it, every section nested in it."""
    fields = list(cls.model_fields) if fields is None else fields
    children, after = {}, []
    for name in fields:
        field = cls.model_fields[name]
        nested = _nested(field.annotation)
        if nested:
            sub, mapping = nested
            base = f"{key}.{field.alias or name}"
            placeholder = _PLACEHOLDERS.get(base, "<name>")
            children[field.alias or name] = sub_key = f"{base}.{placeholder}" if mapping else base
            each = f"One entry of `{base}` per {placeholder.strip('<>')}." if mapping else ""
            after += _section(level + 1, sub_key, sub, intro=" ".join(p for p in (_doc(sub), each) if p))
    parts = [f"Class `{cls.__module__}.{cls.__qualname__}`.", intro or _doc(cls)]
    body = "\n\n".join([p for p in parts if p] + ["\n".join(_rows(cls, key, fields, children))])
    return [(level, key, body), *after]


def _model_sections() -> list:

    common = ModelConfig.model_fields
    out = _section(
        2,
        "model",
        ModelConfig,
        intro="Keys every model takes. `model.name` picks the model and so the other keys it takes "
        "(an option the chosen model does not take is an error); they follow, one section per model.",
    )

    def default(field: FieldInfo) -> Any:
        return field.get_default(call_default_factory=True, validated_data={})

    def own(cls: type[BaseModel]) -> list[str]:
        # A model's own keys, and common keys whose default it changes.
        fields = cls.model_fields.items()
        return [n for n, f in fields if n != "name" and (n not in common or default(f) != default(common[n]))]

    for name in model_names():
        cls = get_model(name).config
        # A factory is documented by the import-path section; a model registered by a user's
        # module in this process is not part of the shipped reference.
        if cls is FactoryModelConfig or not cls.__module__.startswith("recsys_dist."):
            continue
        intro = "The [common keys](#model), and:" if own(cls) else "The [common keys](#model) only."
        doc = _doc(cls)
        if doc and doc.strip("`.") != f"model.name: {name}":
            intro = f"{doc} {intro}"
        out += _section(3, f"model.name: {name}", cls, own(cls), intro=intro)
    out += _section(
        3,
        f"model.name: {_IMPORT_PATH}",
        FactoryModelConfig,
        own(FactoryModelConfig),
        intro="A model factory named by import path (or registered with `recsys_dist.register_model` "
        "without a config class) is called as `factory(spec, **model.args)`; `model.args` is checked "
        "against its signature (names, and values against the annotations). The [common keys](#model), and:",
    )
    return out


def config_reference() -> str:
    """The Markdown of ``docs/config.md``: one table of key | type | default | description per
    config section, nested sections after their parent, and one section per registered model."""

    sections: list = []
    for name, field in RunConfig.model_fields.items():
        if name == "model":
            sections += _model_sections()
        else:
            sections += _section(2, name, _strip(field.annotation))
    head = [
        "# Config reference",
        "",
        f"<!-- Generated by `{REGENERATE}` from the config classes; do not edit by hand. -->",
        "",
        "Every key of the run config (`recsys_dist.config.RunConfig`), section by section. A YAML "
        "file sets them as nested mappings, the command line as dotted overrides "
        "(`train.batch_size=64`), applied in order on top of the file: a dotted key changes that one "
        "value and keeps the rest of its section (`model.args.hidden=8`), while a value given whole "
        "replaces the file's value, a mapping as much as a list (`model.args={}` empties the file's "
        "`model.args`; `model.args={hidden: 8}` leaves no other entry). Values are YAML; a relative "
        "path given on the command line is resolved against the current directory, one in a file "
        "against that file's directory. An unknown key, a wrong type or an impossible value is an error "
        "naming the key. Defaults are written as YAML values; `null` is what the descriptions call None.",
        "",
        *(f"{'  ' * (level - 2)}- {_link(key)}" for level, key, _ in sections),
    ]
    body = [f"{_heading(level, key)}\n\n{text}" for level, key, text in sections]
    return "\n\n".join(["\n".join(head), *body]) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(config_reference())
