"""What every config section shares: strict validation, int64 bounds, and the error type.

A section is a pydantic model with ``extra="forbid"``: an unknown key, a wrong type or an
impossible value is reported with its dotted key. Components define their own section
(``recsys_dist.data.config.DataConfig``, ``recsys_dist.distributed.config.ShardingConfig``, ...) on
top of :class:`Section`; ``recsys_dist.config.run.RunConfig`` composes them.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Annotated, Any, get_origin

from pydantic import BaseModel, ConfigDict, Strict, TypeAdapter, ValidationError, field_validator

from recsys_dist.errors import ConfigError  # noqa: F401 (raised here; defined in errors)

# A YAML list may fill a tuple field (strict mode wants a tuple), but its items stay strict.
StrictFloat = Annotated[float, Strict()]


def _too_big(value) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return not -(2**63) <= value < 2**63
    if isinstance(value, (list, tuple)):  # not into mappings: a section checks its own keys
        return any(_too_big(v) for v in value)
    return False


class Section(BaseModel):
    """Base of every config section: unknown keys, inf / nan and loose types are errors."""

    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _fits_int64(cls, value):
        # torch takes sizes and seeds as int64: a larger int would pass here and fail deep in torch.
        if _too_big(value):
            raise ValueError("an integer here must lie within int64 (|x| < 2^63)")
        return value


# A key of pydantic's validation ``context``: False skips the checks that import a user's module
# named by import path (``model.name``, ``train.loss``), for a command that never runs that code
# (``recsys-dist preprocess``: no torch, no model); a command that trains checks them.
IMPORT_USER_CODE = "import_user_code"


def imports_user_code(info: Any) -> bool:
    """Whether a validator (given pydantic's ``ValidationInfo``) may import a user's module."""
    context = getattr(info, "context", None)
    return not isinstance(context, dict) or bool(context.get(IMPORT_USER_CODE, True))


def is_import_path(name: str) -> bool:
    """True for ``"package.module:attribute"``, the form that names a user's object in YAML."""
    return ":" in name


def import_object(path: str, key: str) -> Any:
    """The object named ``"package.module:attribute"`` (attribute may be dotted).

    Raises:
        ValueError: the module cannot be imported or has no such attribute; the message
            names the config ``key`` and says to check PYTHONPATH.
    """
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{key}: {path!r} is not an import path; write 'package.module:Name'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{key}: cannot import module {module_name!r} ({err}); is its folder on PYTHONPATH?") from None
    except Exception as err:  # noqa: BLE001 - the user's module raised while importing: name the key
        raise ValueError(
            f"{key}: importing module {module_name!r} failed: {type(err).__name__}: {err}; fix that module"
        ) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def format_validation_errors(err: Any, source: str, overridden: frozenset = frozenset(), prefix: str = "") -> str:
    """A pydantic ``ValidationError`` as one message: ``invalid config <source>:`` then one line
    per problem, ``dotted.key: what is wrong`` (``prefix``: the section the model validated, when
    it was validated alone); ``overridden``: dotted keys set on the command line, named as such."""
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            parent = loc.rpartition(".")[0]
            lines.append(f"  {loc}: unknown key (remove it, or check the spelling under '{parent or 'top level'}')")
        elif e["type"] == "missing":
            lines.append(f"  {loc}: required key is missing")
        elif e["type"] in ("value_error", "assertion_error"):
            lines.append(f"  {loc or 'config'}: {msg}")
        else:
            lines.append(f"  {loc}: {msg} (got {e.get('input')!r})")
        if any(loc == k or loc.startswith(k + ".") for k in overridden):
            lines[-1] += "; set on the command line, not in the file"
    return "\n".join(lines)


def typed_arg_problems(key: str, name: str, factory: Any, args: dict, names: Any = None) -> list[str]:
    """Keyword ``args`` of the user's ``factory`` checked against its annotations with pydantic's
    lax conversion (``8`` is fine for a float, a list for a tuple); a converted value replaces
    the given one in ``args``. One problem per bad value, as ``<key>.<arg>: <name> takes <arg>:
    <type>; got <value> (<type>): <why>`` (``key``: ``model.args`` or ``data.format_args``).
    ``names``: the arguments to check (default: all). Annotations that do not evaluate or that
    pydantic cannot check (a name imported for type checkers only, an arbitrary class) are not
    checked."""
    try:
        resolved = inspect.signature(factory, eval_str=True).parameters
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate: check none
        return []
    problems = []
    for arg, value in list(args.items()):
        p = resolved.get(arg)
        if (names is not None and arg not in names) or p is None or p.annotation is p.empty:
            continue
        if isinstance(p.annotation, str):
            continue
        try:
            adapter = TypeAdapter(p.annotation, config=ConfigDict(arbitrary_types_allowed=True))
        except Exception:  # noqa: BLE001 - pydantic cannot check this type
            try:
                adapter = TypeAdapter(p.annotation)
            except Exception:  # noqa: BLE001
                continue
        try:
            args[arg] = adapter.validate_python(value)
        except ValidationError as err:
            why = err.errors()[0]["msg"] if err.errors() else str(err)
            ann = p.annotation
            shown = str(ann) if get_origin(ann) is not None else getattr(ann, "__name__", str(ann))
            shown = shown.replace("typing.", "").replace("collections.abc.", "")
            problems.append(f"{key}.{arg}: {name} takes {arg}: {shown}; got {value!r} ({type(value).__name__}): {why}")
    return problems
