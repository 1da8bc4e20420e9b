"""A deployable artefact: the unsharded model as TorchScript that takes plain tensors.

``recsys-dist export RUN --out DIR --format torchscript`` writes, besides the safetensors
export, ``DIR/model.torchscript.pt`` and ``DIR/serving.json``. The artefact loads with
``torch.jit.load`` alone (no recsys_dist, torchrec or fbgemm import) and computes::

    logits = model(dense, values, lengths)      # float32 [B]; probability = sigmoid(logits)

- ``dense``: float32 ``[B, D]``, the dense features in ``serving.json["dense"]`` order, already
  transformed (``[B, 0]`` for a model without dense features: it gives the batch size);
- ``values``: int64 ``[N]``, the ids of every sparse feature, feature by feature in
  ``serving.json["sparse"]`` order, and within a feature row by row;
- ``lengths``: int32 or int64 ``[F * B]``, ids per row of each feature in the same order
  (1 for a one-hot feature; any number, 0 included, for a multi-hot bag).

This is TorchRec's KeyedJaggedTensor layout. Ids are already mapped, in ``[0, num_embeddings)``:
the hashing or vocabulary lookup and the dense transform are not in the artefact. The
converted Parquet that ``recsys-dist preprocess`` (or ``predict`` on a raw file) writes holds
exactly these inputs (docs/serving.md).

How: every TorchRec ``EmbeddingBagCollection`` of the model is replaced by a plain-torch twin
(one ``nn.EmbeddingBag`` per table, the same weights, pooling and kernel), scripted so that
the jagged split of ``values`` is computed at run time; the rest of the model is traced with
that twin inside. The artefact is checked against the original model on random inputs of
several batch sizes, empty bags included, before anything is written, and its graph must
hold only ``aten`` / ``prim`` operators: a model that cannot be expressed that way is refused
with :class:`ExportError` naming why.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import torch
from torch import nn

from recsys_dist.data.loader import CTRBatch
from recsys_dist.errors import ExportError  # noqa: F401 (raised here; defined in errors)
from recsys_dist.files import write_atomic

SERVING_FILE = "model.torchscript.pt"
SERVING_JSON = "serving.json"
# Largest difference allowed between the artefact's logits and the model's when checking it.
TOLERANCE = 1e-6


class _Lookup(nn.Module):
    """Pooled embeddings of one EmbeddingBagCollection, from plain (values, lengths) tensors.

    ``bags[t]`` reads the features ``table_features[t]`` (indices into the artefact's feature
    order, ``num_features`` of them); the output is one float32 ``[B, width]`` tensor per
    (table, feature), tables in order, as the collection's KeyedTensor orders its keys.
    Scripted, so the split of ``values`` by feature is computed for each call.
    """

    def __init__(
        self, bags: list[nn.EmbeddingBag], table_features: list[list[int]], names: list[str], num_features: int
    ) -> None:
        super().__init__()
        self.bags = nn.ModuleList(bags)
        self.table_features = table_features
        self.names = names
        self.rows = [int(b.num_embeddings) for b in bags]
        self.num_features = num_features

    def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
        if values.dim() != 1 or lengths.dim() != 1:
            raise ValueError("values and lengths must be 1-d tensors (int64 ids; ids per row, feature-major)")
        if lengths.numel() % self.num_features != 0:
            raise ValueError(
                "lengths has "
                + str(lengths.numel())
                + " entries; expected F * B with F = "
                + str(self.num_features)
                + " sparse features"
            )
        batch = lengths.numel() // self.num_features
        per_row = lengths.to(torch.int64).view(self.num_features, batch)
        per_feature = per_row.sum(1)
        if int(per_feature.sum()) != values.numel():
            raise ValueError(
                "values has " + str(values.numel()) + " ids but lengths sum to " + str(int(per_feature.sum()))
            )
        starts = torch.cumsum(per_feature, 0) - per_feature
        ids = values.to(torch.int64)
        out: list[torch.Tensor] = []
        t = 0
        for bag in self.bags:
            for f in self.table_features[t]:
                v = ids.narrow(0, int(starts[f]), int(per_feature[f]))
                if v.numel() > 0 and (int(v.min()) < 0 or int(v.max()) >= self.rows[t]):
                    raise ValueError(
                        "sparse feature "
                        + self.names[f]
                        + ": ids must lie in [0, "
                        + str(self.rows[t])
                        + "), got "
                        + str(int(v.min()))
                        + " .. "
                        + str(int(v.max()))
                    )
                offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(per_row[f], 0)])
                out.append(bag(v, offsets).float())
            t += 1
        return out


class _CheckInputs(nn.Module):
    """Scripted checks of the artefact's inputs: ``dense`` float32 ``[B, num_dense]`` with the
    same ``B`` as ``lengths`` (``[num_features * B]``); returns ``dense``."""

    def __init__(self, num_dense: int, num_features: int) -> None:
        super().__init__()
        self.num_dense, self.num_features = num_dense, num_features

    def forward(self, dense: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if dense.dim() != 2 or dense.shape[1] != self.num_dense or dense.dtype != torch.float32:
            raise ValueError(
                "dense must be float32 [B, "
                + str(self.num_dense)
                + "], got "
                + str(dense.dtype)
                + " "
                + str(dense.shape)
            )
        if lengths.numel() != self.num_features * dense.shape[0]:
            raise ValueError(
                "lengths has "
                + str(lengths.numel())
                + " entries; expected "
                + str(self.num_features)
                + " sparse features x B = "
                + str(dense.shape[0])
                + " rows (dense's first dimension)"
            )
        return dense


class _SparseInput:
    """Stands for the model's KeyedJaggedTensor while tracing: only an EmbeddingBagCollection
    (replaced by :class:`_PlainEBC`) may receive it. Anything else the model does with it
    (read a feature, its keys, its lengths) cannot be replayed from plain tensors."""

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor) -> None:
        object.__setattr__(self, "_tensors", (values, lengths))

    def __getattr__(self, name: str):
        raise ExportError(
            f"the model uses its sparse input (KeyedJaggedTensor.{name}) outside an EmbeddingBagCollection; "
            "only models whose KeyedJaggedTensor goes straight into EmbeddingBagCollections can be exported "
            "to TorchScript (the safetensors export works for any model)"
        )


class _PlainEBC(nn.Module):
    """An EmbeddingBagCollection's twin in plain torch: the same tables (weights copied),
    pooling and output keys, taking :class:`_SparseInput`, returning the KeyedTensor the
    collection would."""

    def __init__(self, ebc, sparse_names: list[str], where: str) -> None:
        super().__init__()
        from torchrec.modules.embedding_modules import get_embedding_names_by_table

        if ebc.is_weighted():
            raise ExportError(f"{where}: a weighted EmbeddingBagCollection (per-id weights) is not supported")
        configs = ebc.embedding_bag_configs()
        bags, table_features = [], []
        for config in configs:
            src = ebc.embedding_bags[config.name]
            unknown = [f for f in config.feature_names if f not in sparse_names]
            if unknown:
                raise ExportError(f"{where}: table {config.name} reads features {unknown} that are not model inputs")
            bag = nn.EmbeddingBag(
                src.num_embeddings, src.embedding_dim, mode=src.mode, include_last_offset=True, dtype=src.weight.dtype
            )
            bag.weight = nn.Parameter(src.weight.detach().clone(), requires_grad=False)
            bags.append(bag)
            table_features.append([sparse_names.index(f) for f in config.feature_names])
        self.keys = [k for names in get_embedding_names_by_table(configs) for k in names]
        self.length_per_key = [c.embedding_dim for c in configs for _ in c.feature_names]
        self.lookup = torch.jit.script(_Lookup(bags, table_features, list(sparse_names), len(sparse_names)))
        self.where = where

    def forward(self, sparse):
        from torchrec.sparse.jagged_tensor import KeyedTensor

        if not isinstance(sparse, _SparseInput):
            raise ExportError(
                f"{self.where} is called with {type(sparse).__name__}, not the model's own sparse input; "
                "only models that pass their KeyedJaggedTensor unchanged to their EmbeddingBagCollections "
                "can be exported to TorchScript"
            )
        pooled = self.lookup(*sparse._tensors)
        return KeyedTensor(keys=self.keys, length_per_key=self.length_per_key, values=torch.cat(pooled, dim=1))


class _Serving(nn.Module):
    """``forward(dense, values, lengths) -> logits [B]``: the model with plain-torch tables."""

    def __init__(self, model: nn.Module, bf16: bool, num_dense: int, num_features: int) -> None:
        super().__init__()
        self.model, self.bf16 = model, bf16
        self.check = torch.jit.script(_CheckInputs(num_dense, num_features))

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        dense = self.check(dense, lengths)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(dense, _SparseInput(values, lengths))
        if logits.dim() == 2 and logits.shape[1] == 1:  # [B, 1] -> [B], as CTRTask does
            logits = logits.squeeze(-1)
        return logits.float()


def _twin(model: nn.Module, sparse_names: list[str]) -> nn.Module:
    """A copy of ``model`` with every EmbeddingBagCollection replaced by :class:`_PlainEBC`."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    twin = copy.deepcopy(model)
    found = 0
    for name, module in list(twin.named_modules()):
        for child_name, child in list(module.named_children()):
            where = f"{type(model).__name__}.{name + '.' if name else ''}{child_name}"
            if isinstance(child, EmbeddingCollection):
                raise ExportError(f"{where}: an EmbeddingCollection (unpooled sequence embeddings) is not supported")
            if isinstance(child, EmbeddingBagCollection):
                module._modules[child_name] = _PlainEBC(child, sparse_names, where)
                found += 1
            elif type(child).__module__.startswith("torchrec.distributed"):
                raise ExportError(f"{where}: a sharded module ({type(child).__name__}); export the unsharded model")
    if not found:
        raise ExportError(f"{type(model).__name__} holds no EmbeddingBagCollection")
    return twin


def _foreign_ops(graph) -> list[str]:
    """Operators of ``graph`` (blocks and called functions inlined) outside aten / prim."""
    found = set()

    def walk(block) -> None:
        for node in block.nodes():
            ns = node.kind().split("::")[0]
            if ns not in ("aten", "prim"):
                found.add(node.kind())
            for b in node.blocks():
                walk(b)

    walk(graph)
    return sorted(found)


def example_inputs(num_dense: int, sizes: list[int], batch: int, seed: int, multi: bool) -> tuple[torch.Tensor, ...]:
    """Random inputs in the artefact's layout: ids within each table, 0-3 ids per bag
    (empty bags included) when ``multi``, else exactly one."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(batch, num_dense, generator=g)
    lengths = (
        torch.randint(0, 4, (len(sizes), batch), generator=g)
        if multi
        else torch.ones(len(sizes), batch, dtype=torch.int64)
    )
    values = torch.cat([torch.randint(0, n, (int(lengths[f].sum()),), generator=g) for f, n in enumerate(sizes)]).to(
        torch.int64
    )
    return dense, values, lengths.reshape(-1).to(torch.int32)


def reference_logits(task: nn.Module, dense, values, lengths, sparse_names) -> torch.Tensor:
    """The original model's logits [B] on the same inputs (through a real KJT)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    kjt = KeyedJaggedTensor(keys=list(sparse_names), values=values, lengths=lengths)
    b = dense.shape[0]
    batch = CTRBatch(dense_features=dense, sparse_features=kjt, labels=torch.zeros(b), weights=torch.ones(b))
    return task(batch)[1][1]


@torch.no_grad()
def to_torchscript(job, task: nn.Module) -> torch.jit.ScriptModule:
    """The model of ``task`` (a :class:`recsys_dist.models.task.CTRTask`, unsharded, CPU) of the
    run ``job`` (a ``recsys_dist.train.job.Job`` sized as the model's tables: ``job.features``
    names the inputs, ``job.table_sizes`` the rows of each sparse feature's table) as a
    TorchScript module ``(dense, values, lengths) -> logits [B]``.

    Raises:
        ExportError: the model cannot be traced, the trace holds operators other than aten /
            prim (a torchrec or fbgemm kernel), or it disagrees with the model; a model with
            managed-collision tables (its raw-id -> row state is not part of the trace).
    """

    if getattr(task, "remap", None) is not None:
        raise ExportError(
            "export --format torchscript: the model has managed-collision tables (data.categorical_mapping: "
            "managed), whose raw-id -> row mapping the TorchScript model would leave out; use the default "
            "safetensors export, which carries it (docs/managed_collision.md)"
        )
    dense_names, sparse_names, sizes = job.features.dense_names, job.features.keys, job.table_sizes
    task = task.eval()
    name = job.model.name
    try:
        twin = _twin(task.model, sparse_names)
        wrapper = _Serving(twin, task.bf16_device is not None, len(dense_names), len(sparse_names)).eval()
        example = example_inputs(len(dense_names), sizes, 7, 0, multi=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(wrapper, example, check_trace=False)
    except ExportError as err:
        raise ExportError(f"model {name} cannot be exported to TorchScript: {err}") from None
    except Exception as err:  # noqa: BLE001 - tracing fails in many ways; all mean "not exportable"
        raise ExportError(
            f"model {name} cannot be traced to TorchScript ({type(err).__name__}: {str(err)[:500]}); "
            "use the safetensors export"
        ) from None
    foreign = _foreign_ops(traced.inlined_graph)
    if foreign:
        raise ExportError(
            f"model {name}: the traced graph calls operators that plain torch does not have: {', '.join(foreign)}"
        )
    check_artefact(traced, task, job)
    return traced


def check_artefact(artefact, task: nn.Module, job) -> None:
    """Compare ``artefact`` with ``task``'s model (of the run ``job``, as :func:`to_torchscript`)
    on random inputs: batch sizes 1, 3 and 33, one-hot and multi-hot bags (empty ones included).
    Raises ExportError beyond ``TOLERANCE``."""

    dense_names, sparse_names, sizes = job.features.dense_names, job.features.keys, job.table_sizes
    for seed, (batch, multi) in enumerate([(1, False), (3, True), (33, True), (33, False)], start=1):
        dense, values, lengths = example_inputs(len(dense_names), sizes, batch, seed, multi)
        want = reference_logits(task, dense, values, lengths, sparse_names)
        try:
            got = artefact(dense, values, lengths)
        except Exception as err:  # noqa: BLE001
            raise ExportError(
                f"model {job.model.name}: the traced artefact fails on a batch of {batch} rows "
                f"({type(err).__name__}: {str(err)[:300]}); the model cannot be exported to TorchScript"
            ) from None
        diff = (got - want).abs().max().item() if got.shape == want.shape else float("inf")
        if not diff <= TOLERANCE:
            raise ExportError(
                f"model {job.model.name}: the traced artefact differs from the model by {diff:.3g} on a batch of "
                f"{batch} rows (shapes {tuple(got.shape)} vs {tuple(want.shape)}): its forward depends on "
                "something a trace cannot capture (Python control flow on values or shapes); "
                "use the safetensors export"
            )


def serving_spec(job, versions: dict) -> dict:
    """The sidecar ``serving.json`` of the run ``job``'s artefact (as :func:`to_torchscript`): its
    exact input contract; ``versions``: what wrote it (the record's ``written_by``)."""

    dense_names, sparse_names, sizes = job.features.dense_names, job.features.keys, job.table_sizes
    d = job.data
    multi_hot = set(d.schema.multi_hot) if d.schema is not None else set()
    return {
        "artefact": SERVING_FILE,
        "load": "torch.jit.load(path); no recsys_dist, torchrec or fbgemm needed",
        "call": "logits = model(dense, values, lengths)",
        "inputs": {
            "dense": f"float32 [B, {len(dense_names)}]: the dense features in 'dense' order, transformed "
            "(the converted Parquet's columns)",
            "values": "int64 [N]: the ids of every sparse feature, feature by feature in 'sparse' order, "
            "row by row within a feature",
            "lengths": f"int32 or int64 [{len(sparse_names)} * B]: ids per row, feature by feature in 'sparse' "
            "order (1 for one-hot; 0 or more for multi-hot)",
        },
        "output": "float32 [B] logits; probability = sigmoid(logit)",
        "ids": "already mapped (hash or vocabulary, as in preprocessing.json): the converted Parquet's columns; "
        "the artefact does not map raw values",
        "dense": dense_names,
        "sparse": [
            {
                "name": n,
                "num_embeddings": int(rows),
                "pooling": d.feature_pooling.get(n, d.pooling),
                "multi_hot": n in multi_hot,
            }
            for n, rows in zip(sparse_names, sizes)
        ],
        "model": job.model.name,
        "precision": job.train.precision,
        "written_by": versions,
    }


def save_artefact(artefact: torch.jit.ScriptModule, spec: dict, out: Path) -> list[Path]:
    """Write ``out/model.torchscript.pt`` and ``out/serving.json``."""
    out = Path(out)
    write_atomic(out / SERVING_FILE, lambda p: artefact.save(str(p)))
    write_atomic(out / SERVING_JSON, json.dumps(spec, indent=2) + "\n")
    return [out / SERVING_FILE, out / SERVING_JSON]
