"""Retrieval evaluation of a two-tower model: recall@K and NDCG@K over the whole item corpus.

A retrieval model (``two_tower``, ``recsys_dist.models.zoo.two_tower``) registers the hooks at
the end of this module (``recsys_dist.models.registry.ModelSpec``): the Trainer reads the
converted splits once through it (:func:`read_retrieval_data`, rank 0, sent to every rank) and,
on the validation and test splits, :func:`retrieval_metrics` runs the (sharded) item tower over
every item of the corpus and the user tower over every evaluated user, and ranks the corpus for
each user:

- corpus: every distinct id of ``model.item_id`` in the three splits, except the missing-value
  id 0 and, under ``data.categorical_mapping: vocabulary``, the out-of-vocabulary id 1 (it
  stands for many items); an item's features (``model.item_features``) are those of its first
  row (train, then validation, then test).
- users: the ids of the first user feature (``model.user_features[0]``); a user's other user
  features are those of their first row in the evaluated split.
- positives of a user: the split's rows of that user with label 1 (``data.schema.label_threshold``,
  e.g. rating >= 4), one per distinct corpus item not among the user's training items; a
  positive row whose item is not in the corpus (missing or out of vocabulary) stays in the
  denominator as a miss that no method can find. A user counts when they have a positive.
- candidates of a user: the corpus minus the items of the user's training rows.
- ranking: by ``<u, v>`` (the temperature does not change it), descending; ties go to the lower id.
- ``recall@K`` = positives in the top K / positives; ``ndcg@K`` = DCG@K / IDCG@K with gain 1
  per positive, ``DCG = sum_{r <= K} hit_r / log2(r + 1)``, ``IDCG = sum_{r <= min(K, P)}
  1 / log2(r + 1)``; both averaged over users. ``popular_recall@K`` / ``popular_ndcg@K``: the
  same with the items ranked by their training rows (the most-popular baseline).

Memory: the split's rows are held as int64 arrays on every rank, and ``[users, corpus]`` scores
in chunks of ``USER_CHUNK`` users: meant for corpora of up to about a million items.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.data.loader.columns import take_bags
from recsys_dist.data.mapping import MISSING_ID, OOV_ID, load_vocabularies
from recsys_dist.data.spec import FeatureSpec
from recsys_dist.errors import DataError
from recsys_dist.files import write_atomic
from recsys_dist.models.losses import get_loss

DEFAULT_K = (10, 50)
USER_CHUNK = 1024
SPLITS = ("train", "validation", "test")


@dataclass
class Rows:
    """Every row of one split, in file order: per feature ``(lengths int64 [N], values int64)``
    and the first label column (float32 [N])."""

    ids: dict[str, tuple[np.ndarray, np.ndarray]]
    labels: np.ndarray

    def one_hot(self, name: str) -> np.ndarray:
        """int64 [N]: the id of a one-hot feature per row (0 where a row has none)."""
        lengths, values = self.ids[name]
        out = np.zeros(len(lengths), dtype=np.int64)
        has = lengths > 0
        out[has] = values[np.concatenate([[0], np.cumsum(lengths)[:-1]])[has]]
        return out


@dataclass
class Entities:
    """Rows of a KJT for one tower: ids (int64 [N]) and every feature's bags for those rows."""

    ids: np.ndarray
    bags: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


@dataclass
class EvalUsers:
    """The users of one evaluated split: ``users`` (with their user-feature bags), per user
    their positives (int64 item ids, one per positive; ids outside the corpus are misses) and
    their training items (excluded from their candidates)."""

    users: Entities
    positives: list[np.ndarray]
    seen: list[np.ndarray]


@dataclass
class RetrievalData:
    """What the retrieval evaluation needs, read once from the converted splits.

    Attributes:
        sparse_names: the KJT keys, in the model's order.
        corpus: the items (item-tower features per corpus id; ``corpus.ids`` ascending).
        train_counts: int64 [num_items]: training rows per item id (logQ, most-popular baseline).
        splits: ``{"validation": EvalUsers, "test": EvalUsers}``.
        item_id: the feature whose ids are the items (``model.item_id``).
    """

    sparse_names: list[str]
    corpus: Entities
    train_counts: np.ndarray
    splits: dict[str, EvalUsers]
    item_id: str = ""


def read_rows(files: list[str], features: FeatureSpec) -> Rows:
    """Every row of the converted ``files`` through the library's loader (one rank, in order)."""
    sparse = features.keys
    loader = ParquetBatchLoader(
        files,
        4096,
        0,
        1,
        features.dense_names,
        sparse,
        num_embeddings=features.id_bounds,
        prefetch=0,
        label_columns=features.label_columns,
    )
    parts: dict[str, list] = {k: [] for k in sparse}
    lab: list = []
    for batch in loader:
        real = batch.weights > 0  # the last batch is padded
        for k in sparse:
            jt = batch.sparse_features[k]
            lengths = jt.lengths().long()
            parts[k].append((lengths[real], jt.values()[torch.repeat_interleave(real, lengths)].long()))
        lab.append(batch.labels.reshape(len(real), -1)[real, 0])
    ids = {
        k: (torch.cat([p[0] for p in v]).numpy(), torch.cat([p[1] for p in v]).numpy())
        if v
        else (np.zeros(0, np.int64),) * 2
        for k, v in parts.items()
    }
    return Rows(ids, torch.cat(lab).float().numpy() if lab else np.zeros(0, np.float32))


def read_retrieval_data(job, paths: dict[str, list[str]]) -> RetrievalData:
    """The corpus, the training counts and the evaluated users of each held-out split, from
    the converted splits ``paths`` (``{split: files}``) of the resolved run ``job``
    (``job.features``: the columns and table sizes; ``job.model``, ``job.data``) (module docstring).

    Raises:
        ValueError: ``model.item_id`` or the user feature is not one-hot in the data.
    """
    m, features = job.model, job.features
    sparse = features.keys
    num_embeddings = [t.num_embeddings for t in [*features.tables, *features.sequence_tables]]
    rows = {s: read_rows(paths[s], features) for s in SPLITS}
    user_key, item_key = m.user_features[0], m.item_id
    for key in (user_key, item_key):
        if any(np.any(r.ids[key][0] > 1) for r in rows.values()):
            raise ValueError(
                f"model: {key!r} has rows with several ids; the user and item ids must be one-hot features"
            )
    items = {s: r.one_hot(item_key) for s, r in rows.items()}
    users = {s: r.one_hot(user_key) for s, r in rows.items()}
    num_items = num_embeddings[sparse.index(item_key)]
    train_counts = np.bincount(items["train"], minlength=num_items).astype(np.int64)

    # The corpus: first row of each item, train first (module docstring).
    excluded = [MISSING_ID, OOV_ID] if job.data.categorical_mapping == "vocabulary" else [MISSING_ID]
    all_items = np.concatenate([items[s] for s in SPLITS])
    row_of = np.concatenate([np.arange(len(items[s])) for s in SPLITS])
    split_of = np.concatenate([np.full(len(items[s]), i) for i, s in enumerate(SPLITS)])
    corpus_ids, first = np.unique(all_items, return_index=True)
    keep = ~np.isin(corpus_ids, excluded)
    corpus_ids, first = corpus_ids[keep], first[keep]
    item_features = m.item_feature_names(sparse)
    corpus = Entities(corpus_ids, _bags_from(rows, split_of[first], row_of[first], item_features))

    # Training items per user, for every split's users.
    order = np.argsort(users["train"], kind="stable")
    tu, ti = users["train"][order], items["train"][order]

    def seen_of(u: int) -> np.ndarray:
        return np.unique(ti[np.searchsorted(tu, u, "left") : np.searchsorted(tu, u, "right")])

    out = {}
    for s in ("validation", "test"):
        r, us, its = rows[s], users[s], items[s]
        pos_rows = np.flatnonzero(r.labels >= 0.5)
        pos_rows = pos_rows[np.argsort(us[pos_rows], kind="stable")]  # by user, then row
        pos_users, starts = np.unique(us[pos_rows], return_index=True)
        split_users, first_row = np.unique(us, return_index=True)
        eval_users, firsts, positives, seen = [], [], [], []
        for u, mine in zip(pos_users, np.split(pos_rows, starts[1:])):
            sn = seen_of(int(u))
            p = its[mine]
            in_corpus = np.isin(p, corpus_ids)
            # one per distinct corpus item not trained on; every out-of-corpus positive row is a miss
            p = np.concatenate([np.setdiff1d(np.unique(p[in_corpus]), sn), p[~in_corpus]])
            if len(p) == 0:
                continue
            eval_users.append(u)
            firsts.append(first_row[np.searchsorted(split_users, u)])
            positives.append(p)
            seen.append(sn)
        idx = np.asarray(firsts, dtype=np.int64)
        bags = {f: take_bags(*r.ids[f], idx) for f in m.user_features}
        out[s] = EvalUsers(Entities(np.asarray(eval_users, dtype=np.int64), bags), positives, seen)
    return RetrievalData(sparse, corpus, train_counts, out, item_key)


def _bags_from(rows: dict, split_idx: np.ndarray, row_idx: np.ndarray, features: list[str]) -> dict:
    """Per feature, the bags of rows ``(SPLITS[split_idx[i]], row_idx[i])``, in that order."""
    # Gathered split by split, then put back in the order asked: entry j of the grouped
    # arrays is position grouped[j].
    grouped = np.concatenate([np.flatnonzero(split_idx == i) for i in range(len(SPLITS))])
    back = np.argsort(grouped)
    out = {}
    for f in features:
        parts = [take_bags(*rows[s].ids[f], row_idx[split_idx == i]) for i, s in enumerate(SPLITS)]
        out[f] = take_bags(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]), back)
    return out


def make_kjt(sparse_names: list[str], entities: Entities, rows: np.ndarray) -> KeyedJaggedTensor:
    """A KJT of the entities ``rows`` (int64 indices), keyed by ``sparse_names`` in order; the
    features the entities do not have get empty bags (their tower is not run on them)."""
    lengths, values = [], []
    n = len(rows)
    for key in sparse_names:
        if key in entities.bags:
            sel, vals = take_bags(*entities.bags[key], rows)
            lengths.append(torch.as_tensor(sel, dtype=torch.int32))
            values.append(torch.as_tensor(vals, dtype=torch.int64))
        else:
            lengths.append(torch.zeros(n, dtype=torch.int32))
            values.append(torch.zeros(0, dtype=torch.int64))
    return KeyedJaggedTensor.from_lengths_sync(sparse_names, torch.cat(values), torch.cat(lengths))


def retrieval_model(model: nn.Module) -> nn.Module:
    """The retrieval model inside a DistributedModelParallel, a DDP wrapper or a ``CTRTask``."""
    found = next((m for m in model.modules() if hasattr(m, "item_vectors")), None)
    if found is None:
        raise ValueError(f"{type(model).__name__} holds no retrieval model (item_vectors / user_vectors)")
    return found


@torch.no_grad()
def embed(
    model: nn.Module, tower: str, sparse_names: list[str], entities: Entities, batch_size: int, device
) -> torch.Tensor:
    """float32 [N, D] (CPU): ``model.<tower>`` (``user_vectors`` / ``item_vectors``) of every
    entity. Collective when a process group exists: each rank embeds an equal share (padded with
    copies of entity 0, so every rank makes the same calls into the sharded tables), then one
    all_gather."""
    m = retrieval_model(model)
    was_training = m.training
    m.eval()
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    n = len(entities.ids)
    steps = max(1, math.ceil(n / (batch_size * world)))
    per_rank = steps * batch_size
    padded = np.zeros(per_rank * world, dtype=np.int64)
    padded[:n] = np.arange(n)
    mine = padded[rank * per_rank : (rank + 1) * per_rank]
    out = [
        getattr(m, tower)(make_kjt(sparse_names, entities, mine[i * batch_size : (i + 1) * batch_size]).to(device))
        for i in range(steps)
    ]
    m.train(was_training)
    local = torch.cat(out).float().contiguous()
    if world > 1:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local)
        local = torch.cat(parts)
    return local[:n].cpu()


def _cells(lists: list[np.ndarray], corpus: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) indices of every corpus id of ``lists[i]`` (row i), ids outside ``corpus``
    (ascending) dropped."""
    row = np.repeat(np.arange(len(lists)), [len(x) for x in lists])
    ids = np.concatenate(lists) if lists else np.zeros(0, np.int64)
    keep = np.isin(ids, corpus)
    return torch.as_tensor(row[keep]), torch.as_tensor(np.searchsorted(corpus, ids[keep]))


def rank_metrics(
    scores, corpus: np.ndarray, positives: list[np.ndarray], seen: list[np.ndarray], ks
) -> dict[str, float]:
    """``recall@K`` and ``ndcg@K`` (module docstring) of ``scores`` float [U, C] (a column per
    ``corpus`` id, ascending; or a function ``(lo, hi) -> [hi - lo, C]`` of a block of users, so
    that the whole [U, C] is never held), users' ``positives`` and ``seen`` items, for each K in
    ``ks``; means over the U users (NaN for none)."""
    ks = sorted(set(ks))
    kmax = min(max(ks), len(corpus))
    per_user: dict[str, list[np.ndarray]] = {f"{name}@{k}": [] for k in ks for name in ("recall", "ndcg")}
    discount = 1.0 / np.log2(np.arange(2, max(ks) + 2))
    idcg = np.array([discount[:n].sum() for n in range(len(discount) + 1)])  # IDCG of n positives in the top
    for lo in range(0, len(positives), USER_CHUNK):
        hi = min(lo + USER_CHUNK, len(positives))
        block = scores(lo, hi) if callable(scores) else scores[lo:hi]
        s = block.double().index_put(_cells(seen[lo:hi], corpus), torch.tensor(float("-inf"), dtype=torch.float64))
        top = torch.sort(-s, dim=1, stable=True).indices[:, :kmax]  # stable: ties to the lower id
        is_positive = torch.zeros(s.shape, dtype=torch.bool)
        is_positive[_cells(positives[lo:hi], corpus)] = True
        hit = is_positive.gather(1, top).numpy()  # [users, kmax]
        num_pos = np.array([len(p) for p in positives[lo:hi]])
        for k in ks:
            h = hit[:, :k]
            per_user[f"recall@{k}"].append(h.sum(axis=1) / num_pos)
            per_user[f"ndcg@{k}"].append((h * discount[: h.shape[1]]).sum(axis=1) / idcg[np.minimum(k, num_pos)])
    n = len(positives)
    # cumsum adds in user order, one at a time: the same float mean as a running sum in a loop
    return {key: (float(np.cumsum(np.concatenate(v))[-1]) / n if n else float("nan")) for key, v in per_user.items()}


def retrieval_metrics(
    model: nn.Module, data: RetrievalData, split: str, ks, batch_size: int, device
) -> dict[str, float]:
    """recall@K / NDCG@K of the model and of the most-popular baseline on ``split``
    (``"validation"`` / ``"test"``), plus ``retrieval_users`` and ``corpus_items``. Collective
    (every rank calls it and gets the same dict)."""
    users = data.splits[split]
    ks = list(ks or DEFAULT_K)
    items = embed(model, "item_vectors", data.sparse_names, data.corpus, batch_size, device).double().T  # [D, C]
    u = embed(model, "user_vectors", data.sparse_names, users.users, batch_size, device).double()  # [U, D]
    corpus = data.corpus.ids
    out = rank_metrics(lambda lo, hi: u[lo:hi] @ items, corpus, users.positives, users.seen, ks)
    popular = torch.as_tensor(data.train_counts[corpus], dtype=torch.float64).expand(len(users.positives), -1)
    out.update({f"popular_{k}": v for k, v in rank_metrics(popular, corpus, users.positives, users.seen, ks).items()})
    out.update(retrieval_users=len(users.positives), corpus_items=len(corpus))
    return out


def retrieval_problems(job) -> list[str]:
    """Problems of a retrieval model with the resolved run ``job`` (``recsys_dist.train.preflight``)."""
    problems = []
    m, d = job.model, job.data
    sparse = job.features.keys
    items = m.item_feature_names(sparse)
    multi_hot = set(d.schema.multi_hot) if d.schema is not None else set()
    for key, names in (("model.user_features", m.user_features), ("model.item_features", items)):
        unknown = [f for f in names if f not in sparse]
        if unknown:
            problems.append(f"{key}: {unknown} are not categorical features; they are {sparse}")
    if not items:
        problems.append("model.item_features: no feature left for the item tower; name some")
    elif m.item_id not in items:
        problems.append(f"model.item_id: {m.item_id!r} is not an item-tower feature; the item features are {items}")
    if d.categorical_mapping == "managed":
        problems.append(
            f"data.categorical_mapping: {m.name} needs table ids (the item corpus and its logQ counts are "
            "per table row), and managed ids are raw 63-bit keys; use vocabulary or hash"
        )
    per_feature = d.managed.features if d.managed is not None else None
    for key, f in (("model.user_features", m.user_features[0]), ("model.item_id", m.item_id)):
        if per_feature and f in per_feature:
            problems.append(
                f"data.managed.features: {f!r} ({key}) is managed, so it carries raw 63-bit keys, while "
                f"{m.name}'s evaluation and item export need its table ids; leave it out of data.managed.features"
            )
        if f in multi_hot:
            problems.append(f"{key}: {f!r} is multi-hot; the user (first user feature) and the item id must be one-hot")
    problems += candidate_loss_problems(m.name, job.train.loss)
    return problems


def candidate_loss_problems(model: str, loss) -> list[str]:
    """``train.loss`` for a model that returns ``candidate_scores`` (two_tower, hstu_retrieval):
    [] when the loss reads them, else the problem naming the fix."""
    try:
        takes = isinstance(loss, str) and "candidate_scores" in getattr(get_loss(loss), "model_outputs", ())
    except ValueError:
        takes = False
    if takes:
        return []
    return [
        f"train.loss: {model} trains with in-batch candidates (it returns candidate_scores); "
        f"{loss!r} takes none: use train.loss: in_batch_softmax"
    ]


ITEM_IDS_FILE, ITEM_EMBEDDINGS_FILE, ITEM_KEYS_FILE = "item_ids.npy", "item_embeddings.npy", "item_keys.npy"


@torch.no_grad()
def export_item_embeddings(job, model: nn.Module, conversion: Path, out: Path) -> list[Path]:
    """Write the item tower's output for every corpus item (module docstring) of the training
    conversion ``conversion`` (a conversion-cache directory with ``manifest.json``), for a
    nearest-neighbour index, into ``out`` (docs/models.md); ``job``: the exported run (its
    FeatureSpec sized as the exported model's tables):

    - ``item_ids.npy``: int64 [C], the model's ids of ``model.item_id``, ascending;
    - ``item_embeddings.npy``: float32 [C, output_dim], unit rows; a user's scores are
      ``item_embeddings @ u`` (inner product = cosine; the temperature changes no ranking);
    - ``item_keys.npy`` (vocabulary mapping only): uint64 [C], each item's 64-bit key (the
      BLAKE2b key of its raw value, ``recsys_dist.data.mapping``), from ``vocabulary.parquet``.

    Raises:
        FileNotFoundError: the conversion or a split of it is gone (run ``recsys-dist preprocess``).
    """
    manifest_path = Path(conversion) / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(
            f"{conversion}: the training conversion is gone; item embeddings need the data's item corpus: "
            "run `recsys-dist preprocess --config CONFIG` with the run's config, then export again"
        )
    files = json.loads(manifest_path.read_text())["files"]
    paths = {s: [str(Path(conversion) / f) for f in files[s]] for s in SPLITS}
    sparse = job.features.keys
    data = read_retrieval_data(job, paths)
    vectors = embed(model, "item_vectors", sparse, data.corpus, 4096, torch.device("cpu"))
    out.mkdir(parents=True, exist_ok=True)
    _save_npy(out / ITEM_IDS_FILE, data.corpus.ids.astype(np.int64))
    _save_npy(out / ITEM_EMBEDDINGS_FILE, vectors.numpy().astype(np.float32))
    written = [out / ITEM_IDS_FILE, out / ITEM_EMBEDDINGS_FILE]
    vocab = Path(conversion) / "vocabulary.parquet"
    if job.data.categorical_mapping == "vocabulary" and vocab.is_file():
        (v,) = load_vocabularies(vocab, [job.model.item_id])
        key_of = np.zeros(v.size, dtype=np.uint64)  # by id; corpus ids are vocabulary ids (2 .. size - 1)
        key_of[v.ids] = v.keys
        _save_npy(out / ITEM_KEYS_FILE, key_of[data.corpus.ids])
        written.append(out / ITEM_KEYS_FILE)
    return written


# The hooks a retrieval model registers (``register_model(..., **RETRIEVAL_HOOKS)``).


def _save_npy(path: Path, array: np.ndarray) -> None:
    """``np.save`` through a file object (a path would gain ``.npy`` after the temporary name)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array)

    write_atomic(path, write)


def with_item_counts(spec: FeatureSpec, data: RetrievalData) -> FeatureSpec:
    """``spec`` with the training split's rows per item id (``spec.id_counts[item_id]``, int64
    [num_items]): the logQ correction's sampling probabilities."""
    return dataclasses.replace(spec, id_counts={data.item_id: data.train_counts})


def evaluate_retrieval(model: nn.Module, data: RetrievalData, split, job, device) -> dict[str, float]:
    """:func:`retrieval_metrics` on ``"validation"`` / ``"test"`` (K of ``eval.retrieval_k``,
    batches of ``eval.batch_size`` or ``train.batch_size``); ``{}`` on any other split or loader.
    Collective."""
    if not isinstance(split, str) or split not in ("validation", "test"):
        return {}
    bs = job.eval.batch_size or job.train.batch_size
    return retrieval_metrics(model, data, split, job.eval.retrieval_k, bs, device)


def export_items(job, model: nn.Module, record: dict, path, out: Path) -> list[Path]:
    """:func:`export_item_embeddings` of the training conversion ``record`` names (the export's
    preprocessing record).

    Raises:
        DataError: the record names no training conversion (an export written without one).
    """
    conversion = (record.get("training_conversion") or {}).get("directory")
    if conversion is None:
        raise DataError(
            f"{path}: no training conversion is recorded, and the item embeddings need the data's item corpus; "
            "export the run's checkpoint (not an export written without it)"
        )
    return export_item_embeddings(job, model, Path(conversion), out)


RETRIEVAL_HOOKS = dict(
    read_data=read_retrieval_data,
    on_data=with_item_counts,
    evaluator=evaluate_retrieval,
    export_extras=export_items,
)
