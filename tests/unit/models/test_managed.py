"""Managed-collision tables (data.categorical_mapping: managed) in process: config errors, the
remapping module's admission, eviction, TTL and counters (against torchrec's per-feature module),
its state round trip, and managed tables for some features only.
"""

import numpy as np
import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from tests.conftest import QUICKSTART

MANAGED = [
    "data.categorical_mapping=managed",
    "data.managed={eviction: lfu, eviction_interval: 3, admission_min_count: 2, ttl_steps: 4}",
    "data.num_embeddings=50",
    "train.epochs=1",  # 16 steps of global batch 96
]


def test_managed_config_errors():
    def errors(*overrides):
        with pytest.raises(ConfigError) as e:
            load_config(QUICKSTART, list(overrides))
        return str(e.value)

    assert "data.managed: required" in errors("data.categorical_mapping=managed")
    assert "eviction_interval: required" in errors("data.categorical_mapping=managed", "data.managed={eviction: lru}")
    assert "ttl_steps" in errors(
        "data.categorical_mapping=managed", "data.managed={eviction: ttl, eviction_interval: 1}"
    )
    for bad in (0, -3):
        msg = errors("data.categorical_mapping=managed", f"data.managed={{eviction_interval: 1, ttl_steps: {bad}}}")
        assert "data.managed.ttl_steps" in msg and "greater than 0" in msg, msg
    assert load_config(QUICKSTART, [*MANAGED[:1], "data.managed={eviction: lru, eviction_interval: 1, ttl_steps: 5}"])
    assert "only used with categorical_mapping: managed" in errors("data.managed={eviction_interval: 1}")
    assert "63-bit" in errors(*MANAGED[:2], "data.num_embeddings=9223372036854775807")
    cfg = load_config(QUICKSTART, MANAGED)
    assert cfg.data.managed.eviction_interval == 3 and cfg.data.managed.admission_min_count == 2


def test_managed_ids_are_the_raw_key():
    from recsys_dist.data.mapping import MANAGED_ID_SPACE, managed_ids

    keys = np.array([0, 1, 2**63 - 2, 2**63 - 1, 2**64 - 1], dtype=np.uint64)
    ids = managed_ids(keys)
    assert ids.dtype == np.int64 and (ids >= 1).all() and (ids < MANAGED_ID_SPACE).all()
    assert ids.tolist()[:2] == [1, 2]  # never reduced to a table size


def _kjt(values, lengths=None):
    import torch
    from torchrec import KeyedJaggedTensor

    v = torch.tensor(values, dtype=torch.int64)
    lengths = (
        torch.ones(len(values), dtype=torch.int32) if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    )
    return KeyedJaggedTensor(keys=["f"], values=v, lengths=lengths, stride=int(lengths.numel()))


def _remap(**kw):
    from recsys_dist.models.managed import ManagedRemap, ReplicatedMCH

    args = {"zch_size": 4, "eviction": "lfu", "eviction_interval": 1, "history_capacity": 16, **kw}
    return ManagedRemap({"f": ReplicatedMCH(**args)})


def test_managed_module_admits_evicts_and_counts():
    import torch

    r = _remap()
    big = 1 << 50
    out = r(_kjt([big + 1, big + 1, big + 2, big + 3]))
    rows = out.values().tolist()
    assert rows[0] == rows[1] and len(set(rows)) == 3 and 3 not in rows  # 3 rows of 4 (row 3: default)
    out = r(_kjt([big + 4, big + 4, big + 4, big + 1]))  # big+4 (3 times) beats big+2 / big+3 (once)
    assert out.values()[0] != 3  # admitted on its first step (interval 1), evicting big+2 or big+3
    st = r.mch["f"].stats()
    assert st["rows_used"] == 3 and st["evictions"] == 1 and st["admissions"] == 4
    r.eval()
    got = r(_kjt([big + 99, big + 1]), torch.tensor([1.0, 1.0])).values().tolist()
    assert got[0] == 3 and got[1] == rows[0]  # unseen id -> default row; nothing recorded in eval
    counts = r.read_lookups("score", reduce=False)
    assert counts.tolist() == [[2, 1]]
    # padding rows (weight 0) are neither recorded nor counted
    r.train()
    before = int(r.mch["f"]._counters[3])
    r(_kjt([big + 7, big + 8]), torch.tensor([1.0, 0.0]))
    assert int(r.mch["f"]._counters[3]) - before <= 1
    assert r.read_lookups("train", reduce=False)[0, 0] == 8 + 2 - 1  # 4 + 4 + 1 counted lookups


def test_managed_state_round_trip_resumes_exactly():
    """A state dict taken mid-interval (pending history) loads into a fresh module that then
    maps and evicts exactly as the uninterrupted one."""
    import torch

    g = torch.Generator().manual_seed(0)
    steps = [((torch.randint(0, 30, (12,), generator=g) ** 2) + (1 << 40)).tolist() for _ in range(9)]
    a = _remap(zch_size=6, eviction="lru", eviction_interval=3, history_capacity=36)
    for s in steps[:4]:
        a(_kjt(s))
    b = _remap(zch_size=6, eviction="lru", eviction_interval=3, history_capacity=36)
    b.load_state_dict(a.state_dict())
    for s in steps[4:]:
        ra, rb = a(_kjt(s)).values(), b(_kjt(s)).values()
        assert torch.equal(ra, rb)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


@pytest.mark.parametrize("interval,admission,ttl", [(1, 1, None), (2, 2, None), (3, 1, None), (1, 1, 2), (2, 2, 5)])
def test_batched_managed_step_matches_torchrec_per_feature(interval, admission, ttl):
    """The batched step (one lookup and one lfu round for all features) against TorchRec's
    per-feature MCH rounds and ``_mch_remap``: same rows, same state, same counts, step for
    step; features of different sizes, multi-hot bags, padding rows, a history that overflows;
    with a TTL, the batched TTL pass against the per-feature one."""
    import torch
    from torchrec import KeyedJaggedTensor

    from recsys_dist.models.managed import ManagedRemap, ReplicatedMCH

    sizes = {"a": 2, "b": 7, "c": 41, "d": 3}
    cap = 40  # some steps do not fit: their round runs early (per feature, through TorchRec)

    def remap():
        return ManagedRemap(
            {
                f: ReplicatedMCH(
                    zch_size=n,
                    eviction="lfu",
                    eviction_interval=interval,
                    admission_min_count=admission,
                    history_capacity=cap,
                    ttl_steps=ttl,
                )
                for f, n in sizes.items()
            }
        )

    fast, slow = remap(), remap()
    slow._batched_round = False
    assert fast._batched_round
    g = torch.Generator().manual_seed(0)
    for step in range(25):
        b = 8
        lengths = torch.randint(0, 3, (len(sizes) * b,), generator=g, dtype=torch.int32)
        per_key = lengths.view(len(sizes), b).sum(1).tolist()
        values = torch.cat(
            [
                (torch.randint(0, 4 * n + 3, (k,), generator=g) ** 2) // (4 * n + 3) + (1 << 45)
                for n, k in zip(sizes.values(), per_key)
            ]
        )
        kjt = KeyedJaggedTensor(keys=list(sizes), values=values, lengths=lengths, stride=b)
        weights = (torch.rand(b, generator=g) > 0.2).float()
        if step % 7 == 6:
            fast.eval(), slow.eval()
        else:
            fast.train(), slow.train()
        got = fast(kjt, weights).values()
        assert torch.equal(got, slow(kjt, weights).values()), step
        # TorchRec's own lookup (_mch_remap) with the state after this step's round
        parts = torch.split(values, per_key)
        want = torch.cat([slow.mch[f].remap_values(p) for f, p in zip(sizes, parts)])
        assert torch.equal(got, want), step
        for k, v in slow.state_dict().items():
            assert torch.equal(fast.state_dict()[k], v), (step, k)
    for split in ("train", "score"):
        assert torch.equal(fast.read_lookups(split, reduce=False), slow.read_lookups(split, reduce=False))
    assert any(m.counters()["evicted"] > 0 for m in fast.mch.values())  # by the policy or the TTL
    assert {f: m.counters() for f, m in fast.mch.items()} == {f: m.counters() for f, m in slow.mch.items()}
    if ttl is not None:
        assert any(m.counters()["evicted_ttl"] > 0 for m in fast.mch.values())


def test_managed_for_some_features(tmp_path, cache_dir):
    """data.managed.features: managed tables for C1 and C2, hash-mod (or the vocabulary) for
    the rest: the converter writes raw 63-bit ids only for those two, the model remaps only
    them, and options a feature's mapping does not use are errors."""
    import pyarrow.parquet as pq
    import torch

    from recsys_dist.config.job import resolve_job
    from recsys_dist.data.loader import ParquetBatchLoader
    from recsys_dist.data.mapping import MANAGED_ID_SPACE, hash_ids, managed_ids
    from recsys_dist.data.resolve import prepare_from_config
    from recsys_dist.models.managed import find_remap
    from recsys_dist.train.build import build_task
    from tests.conftest import base_row

    def errors(*overrides):
        with pytest.raises(ConfigError) as e:
            load_config(QUICKSTART, list(overrides))
        return str(e.value)

    some = "data.managed={eviction: lfu, eviction_interval: 1, features: [C1, C2]}"
    assert "not used with categorical_mapping: managed" in errors("data.categorical_mapping=managed", some)
    assert "only used with categorical_mapping: managed, or with data.managed.features" in errors(
        "data.managed={eviction_interval: 1}"
    )
    assert "not categorical features of criteo_tsv: ['C99']" in errors(
        "data.managed={eviction_interval: 1, features: [C1, C99]}"
    )
    assert "listed twice: ['C1']" in errors("data.managed={eviction_interval: 1, features: [C1, C1]}")

    raw = tmp_path / "raw.txt"
    rows = [base_row(str(i % 2), cats=[f"{(i * 7 + j) % 5 + 1:08x}" for j in range(26)]) for i in range(40)]
    raw.write_text("\n".join(rows) + "\n")
    for mapping in ("hash", "vocabulary"):
        cfg = load_config(
            QUICKSTART,
            [f"data.raw_path={raw}", f"data.categorical_mapping={mapping}", some, "data.num_embeddings=50"]
            + ["distributed.nproc_per_node=1", "train.batch_size=8"],
        )
        job = resolve_job(cfg)
        assert job.features.managed == ["C1", "C2"]
        prepared = prepare_from_config(cfg.data)
        t = pq.read_table(prepared.paths("train")[0])
        keys = np.array([(i * 7) % 5 + 1 for i in range(32)], dtype=np.uint64)  # C1's keys (hex = key)
        assert t.column("C1").to_pylist() == managed_ids(keys).tolist()
        c3 = np.array(t.column("C3").to_pylist())
        if mapping == "hash":
            assert (
                c3.min() >= 1
                and c3.max() < 50
                and set(c3.tolist()) <= set(hash_ids(np.arange(1, 6, dtype=np.uint64), 50).tolist())
            )
            sizes = job.table_sizes  # as configured
        else:
            assert c3.min() >= 1 and c3.max() < 7  # 5 values: ids 2..6
            sizes = list(prepared.num_embeddings)
            assert sizes[:2] == [50, 50] and sizes[2] == 7  # managed features keep their configured rows
        job = job.with_data(prepared)
        assert job.table_sizes == sizes
        bounds = job.features.id_bounds
        assert bounds[:2] == [MANAGED_ID_SPACE] * 2 and bounds[2:] == sizes[2:]
        model = build_task(job, job.features.on(torch.device("cpu")))
        remap = find_remap(model)
        assert list(remap.mch) == ["C1", "C2"]
        dense, sparse = job.features.dense_names, job.features.keys
        loader = ParquetBatchLoader(prepared.paths("train")[0], 8, 0, 1, dense, sparse, num_embeddings=bounds)
        batch = next(iter(loader))
        loss, _ = model(batch)
        assert torch.isfinite(loss)
        mapped = remap(batch.sparse_features, batch.weights).to_dict()
        raw_kjt = batch.sparse_features.to_dict()
        assert mapped["C1"].values().max() < 50  # remapped to rows
        assert torch.equal(mapped["C3"].values(), raw_kjt["C3"].values())  # passed through


COLD_A, COLD_B, HOT_C, HOT_D = [(1 << 50) + i for i in range(4)]


def _ttl_stream(step: int) -> list[int]:
    """A and B at steps 1-3 only (A back once at step 7), C and D at every step."""
    if step <= 3:
        return [COLD_A, COLD_B, HOT_C, HOT_D]
    return [COLD_A, HOT_C, HOT_D] if step == 7 else [HOT_C, HOT_D]


def _lookup(r, ids):
    r.eval()
    rows = r(_kjt(ids)).values().tolist()
    r.train()
    return rows


@pytest.mark.parametrize("eviction", ["lfu", "lru", "distance_lfu"])
def test_managed_ttl_evicts_cold_ids_and_counts(eviction):
    """data.managed.ttl_steps: 3, rounds every 2 steps, 7 usable rows (never full, so the
    policy evicts nothing): A and B, last seen at step 3, keep their rows at the round of step
    4 (1 step unseen) and lose them at the round of step 6 (3 steps unseen: 6 - 3 >= 3); C and
    D keep theirs. Without ttl_steps the same stream keeps A and B. Counters by hand:
    collided = 4 (step 1: no row before the first round) + 1 (A at step 7, before its round)."""
    import torch

    from recsys_dist.models.task import CTRTask

    default = 7
    for ttl in (3, None):
        r = _remap(zch_size=8, eviction=eviction, eviction_interval=2, history_capacity=64, ttl_steps=ttl)
        seen = []
        for step in range(1, 9):
            r(_kjt(_ttl_stream(step)))
            seen.append(_lookup(r, [COLD_A, COLD_B, HOT_C, HOT_D]))
        held = seen[1]  # after the first round (step 2): four distinct rows
        assert default not in held and len(set(held)) == 4
        assert seen[4] == held  # step 5: A and B unseen for 2 steps, under the TTL of 3
        c = CTRTask(torch.nn.Identity(), remap=r).managed_counters()["f"]  # the model's hook
        if ttl is None:
            assert seen[5] == seen[7] == held
            assert c == {"admitted": 4, "evicted": 0, "evicted_ttl": 0, "collided": 4}
            continue
        assert seen[5] == [default, default, held[2], held[3]]  # step 6: A and B read the default row
        assert seen[6] == seen[5]  # step 7: A seen again, no round yet
        assert seen[7][0] != default and seen[7][1:] == seen[5][1:]  # step 8: A re-admitted
        assert c == {"admitted": 5, "evicted": 2, "evicted_ttl": 2, "collided": 5}
        assert r.mch["f"].stats()["rows_used"] == 3
        # the metrics line's cumulative counters; the train default-row lookups (this
        # process's, from the local lookups) sum to the same collided count
        assert r.read_lookups("train", reduce=False)[0, 1] == 5
        got = CTRTask(torch.nn.Identity(), remap=r).managed_metrics("train")["managed"]["f"]
        assert {k: got[k] for k in ("admitted_total", "evicted_total", "evicted_ttl_total", "collided_total")} == {
            "admitted_total": 5,
            "evicted_total": 2,
            "evicted_ttl_total": 2,
            "collided_total": 5,
        }
    plain = CTRTask(torch.nn.Linear(1, 1))  # no managed tables: the hooks answer {}
    assert plain.managed_counters() == {} and plain.managed_metrics("train") == {}


@pytest.mark.parametrize("eviction", ["lfu", "lru"])
def test_managed_ttl_state_round_trip(eviction):
    """A state dict taken at step 5 (mid-interval: a pending history, A and B's rows close to
    their TTL) loads into a fresh module; both then map, expire and count exactly alike, and
    padding rows (weight 0) are neither recorded nor counted as collided."""
    import torch

    def fresh():
        return _remap(zch_size=8, eviction=eviction, eviction_interval=2, history_capacity=64, ttl_steps=3)

    g = torch.Generator().manual_seed(1)
    steps = [_ttl_stream(s) + ((torch.randint(0, 6, (3,), generator=g) + (1 << 45)).tolist()) for s in range(1, 13)]

    def pad(s):  # the last row is padding
        return torch.tensor([1.0] * (len(s) - 1) + [0.0])

    a = fresh()
    for s in steps[:5]:
        a(_kjt(s), pad(s))
    b = fresh()
    b.load_state_dict(a.state_dict())
    assert {"mch.f._row_last_seen", "mch.f._totals"} <= set(b.state_dict())
    for s in steps[5:]:
        assert torch.equal(a(_kjt(s), pad(s)).values(), b(_kjt(s), pad(s)).values())
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    ca, cb = a.mch["f"].counters(), b.mch["f"].counters()
    assert ca == cb and ca["evicted_ttl"] >= 2, ca
    # collided: every real (weight > 0) default-row lookup of the 12 steps, both halves
    lookups = a.read_lookups("train", reduce=False)[0, 1]
    assert ca["collided"] == int(lookups) > 0
