"""The model registry: the shipped models and any a user adds by name or import path.

A model is a builder ``build(spec: FeatureSpec, cfg: <its ModelConfig>) -> nn.Module`` whose
module's ``forward(dense: Tensor[B, num_dense] float32, sparse: KeyedJaggedTensor)`` returns
logits ``Tensor[B]``, ``Tensor[B, 1]`` or ``Tensor[B, num_tasks]``. The shipped models live one
family per file in ``recsys_dist/models/zoo/`` and register on import; every module there is
imported the first time the registry is read, so a new model is one new file.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field, ValidationInfo, model_validator

from recsys_dist.models import zoo
from recsys_dist.models.checks import one_task
from recsys_dist.models.config import SHIPPED_MODEL_CONFIGS, ModelConfig
from recsys_dist.section import import_object, imports_user_code, is_import_path, typed_arg_problems


class FactoryModelConfig(ModelConfig):
    """A model built by a factory ``fn(spec: FeatureSpec, **model.args) -> nn.Module``: named by
    import path in YAML, or registered with ``register_model(name)`` (no config class)."""

    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the model factory.")

    @model_validator(mode="after")
    def _check_args(self, info: ValidationInfo) -> FactoryModelConfig:
        if is_import_path(self.name) and not imports_user_code(info):
            return self  # checked by the command that builds the model (preprocess imports none)
        factory = model_factory(self.name)
        try:
            params = inspect.signature(factory).parameters
        except (TypeError, ValueError):  # a builtin or C callable: nothing to check
            return self
        names = list(params)
        if not names:
            raise ValueError(f"model.name: {self.name} takes no arguments; it must take the FeatureSpec first")
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        rest = {n: p for n, p in list(params.items())[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = [k for k in self.args if k not in rest and not takes_kwargs]
        missing = [n for n, p in rest.items() if p.default is p.empty and n not in self.args]
        problems = [f"model.args.{k}: {self.name} takes no argument {k!r} (it takes {sorted(rest)})" for k in unknown]
        problems += [f"model.args.{k}: required by {self.name}, missing" for k in missing]
        problems += typed_arg_problems("model.args", self.name, factory, self.args, rest)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def model_factory(name: str):
    """The factory behind a :class:`FactoryModelConfig` name (registered name or import path)."""
    if is_import_path(name):
        factory = import_object(name, "model.name")  # a module that raises is a ValueError naming the key
        if not callable(factory):
            raise ValueError(f"model.name: {name} is not callable; name a model class or factory function")
        return factory
    return get_model(name).factory


def model_config_class(name: Any) -> type[ModelConfig]:
    """The config class that validates a ``model:`` section with this ``name``.

    Raises:
        ValueError: an unknown name; the message lists the registered ones.
    """
    if not isinstance(name, str):
        raise ValueError(f"model.name: expected a model name or 'package.module:factory', got {name!r}")
    if is_import_path(name):
        return FactoryModelConfig
    # Read without loading the zoo (torch): a shipped name from the torch-free table, any other
    # from _MODELS, which register_model fills only after loading the zoo (so before, it is empty).
    if name in SHIPPED_MODEL_CONFIGS:
        return SHIPPED_MODEL_CONFIGS[name]
    if name in _MODELS:
        return _MODELS[name].config
    registered = sorted({*SHIPPED_MODEL_CONFIGS, *_MODELS})
    raise ValueError(
        f"model.name: unknown model {name!r}; registered: {', '.join(registered)}, or give an import "
        "path 'package.module:factory'"
    )


Check = Callable[[Any], list[str]]
"""``check(job) -> list[str]``: a model's own problems with the resolved run (``job``: a
``recsys_dist.train.job.Job``: its sections and its FeatureSpec), each
"dotted.key: what is wrong; the fix" (``recsys_dist.train.preflight.section_problems``)."""


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: what builds it and the hooks the core calls (never flags to branch on).

    Attributes:
        name: the ``model.name`` that selects it.
        config: its config class (a :class:`ModelConfig` subclass whose ``name`` is this name).
        build: ``build(spec, cfg) -> nn.Module``.
        factory: for a model registered as ``factory(spec, **model.args)``, that factory.
        checks: ``check(job) -> list[str]`` each, run by preflight on every run naming the
            model (``recsys_dist.models.checks`` holds the shipped ones: dense features needed,
            one task only, no sequence features).
        on_features: ``on_features(spec) -> FeatureSpec``: the tables the model adds to the
            data's (DeepFM's first-order ``w_<feature>``, ``recsys_dist.models.zoo.fm``); every
            FeatureSpec of the model goes through it (training, planning, export).
        read_data: ``read_data(job, paths) -> data``: what the model reads from
            the converted splits (``paths``: ``{split: [file, ...]}``), once, on rank 0, before
            sharding; the Trainer sends ``data`` (picklable) to every rank.
        on_data: ``on_data(spec, data) -> FeatureSpec``: the spec the model is built over, given
            ``data`` (two_tower: the item counts of its logQ correction, ``spec.id_counts``).
        evaluator: ``evaluator(model, data, split, job, device) -> dict[str, float]``: metrics
            added to ``Trainer.evaluate``'s (two_tower: recall@K / NDCG@K over the item corpus,
            ``recsys_dist.models.retrieval``). Collective: every rank calls it.
        export_extras: ``export_extras(job, model, record, path, out) -> list[Path]``: files
            ``recsys_dist.serve.export.export`` adds to an export in ``out`` (``record``: the
            preprocessing record; ``path``: what was exported, for messages).
    """

    name: str
    config: type[ModelConfig]
    build: Callable
    factory: Callable | None = None
    checks: tuple[Check, ...] = ()
    on_features: Callable | None = None
    read_data: Callable | None = None
    on_data: Callable | None = None
    evaluator: Callable | None = None
    export_extras: Callable | None = None

    def problems(self, job) -> list[str]:
        """Every problem of the resolved run ``job`` that this model's checks find, in order."""
        return [p for check in self.checks for p in check(job)]


def _given_elsewhere(spec: object, cfg: ModelConfig):
    raise TypeError("the model given to Trainer(model=...) is built by the Trainer from that argument")


# The model given to ``Trainer(model=...)`` instead of ``model.name``: none of the checks and hooks
# of the model the config names by default (dlrm needs dense features) apply to it.
GIVEN_MODEL = ModelSpec("Trainer(model=...)", ModelConfig, _given_elsewhere)

_MODELS: dict[str, ModelSpec] = {}
_loaded = False


def register_model(
    name: str,
    config: type[ModelConfig] | None = None,
    *,
    checks: Sequence[Check] | None = None,
    on_features: Callable | None = None,
    read_data: Callable | None = None,
    on_data: Callable | None = None,
    evaluator: Callable | None = None,
    export_extras: Callable | None = None,
):
    """Decorator that makes a model selectable as ``model.name: <name>``.

    With ``config`` (a :class:`ModelConfig` subclass), the decorated function is
    ``build(spec, cfg) -> nn.Module`` and ``model:`` keys validate against ``config``.

    Without it, the function (or class) is a factory ``factory(spec, **model.args)`` and
    ``model.args`` is checked against its signature.

    ``checks`` (default: ``(checks.one_task,)`` with a config class, since a model with typed
    options states its output width; none for a factory, whose width is checked at run time)
    and the hooks ``on_features``, ``read_data``, ``on_data``, ``evaluator``,
    ``export_extras``: see :class:`ModelSpec`.

    Example::

        @recsys_dist.register_model("my_tower")
        def my_tower(spec, hidden: int = 64):
            return MyTower(spec, hidden)

    Raises:
        ValueError: the name is taken, or is an import path.
    """
    if ":" in name:
        raise ValueError(f"register_model: {name!r} contains ':'; import paths need no registration")
    if checks is None:
        checks = (one_task,) if config is not None else ()
    hooks = dict(
        checks=tuple(checks),
        on_features=on_features,
        read_data=read_data,
        on_data=on_data,
        evaluator=evaluator,
        export_extras=export_extras,
    )

    def wrap(fn):
        # A zoo module registering loads no other zoo module: those it is imported by (through a
        # module of recsys_dist.models that imports a zoo module) may not be initialised yet.
        if not getattr(fn, "__module__", "").startswith(zoo.__name__ + "."):
            _load_builtin()
        if name in _MODELS:
            raise ValueError(f"register_model: model {name!r} is registered already")
        if config is None:
            _MODELS[name] = ModelSpec(
                name, FactoryModelConfig, lambda spec, cfg: fn(spec, **cfg.args), factory=fn, **hooks
            )
        else:
            _MODELS[name] = ModelSpec(name, config, fn, None, **hooks)
        return fn

    return wrap


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for info in pkgutil.iter_modules(zoo.__path__):
        importlib.import_module(f"{zoo.__name__}.{info.name}")


def get_model(name: str) -> ModelSpec:
    """The registered model ``name``; for an import path, the registered model whose factory it
    names (with its checks and hooks), else a spec around that factory (no hooks).

    Raises:
        KeyError: no model of that name is registered.
    """
    _load_builtin()
    if is_import_path(name):
        factory = model_factory(name)
        # A factory its module registers (``@register_model("x", checks=..., on_features=...)``)
        # keeps its checks and hooks when YAML names it by import path.
        registered = next((m for m in _MODELS.values() if m.factory is factory), None)
        if registered is not None:
            return dataclasses.replace(registered, name=name)
        return ModelSpec(name, FactoryModelConfig, lambda spec, cfg: factory(spec, **cfg.args), factory)
    return _MODELS[name]


def model_names() -> list[str]:
    """Every registered model name, sorted."""
    _load_builtin()
    return sorted(_MODELS)
