import json

import numpy as np
import pyarrow.parquet as pq

from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.convert.manifest import VOCABULARY_FILE
from recsys_dist.data.formats.criteo import CRITEO
from recsys_dist.data.mapping import OOV_ID, VocabularyCounter
from tests.conftest import base_row

CATS = [f"{i:08x}" for i in range(1, 27)]


def cats(c1: str) -> list[str]:
    return [c1] + CATS[1:]


def write(tmp_path, rows, name="raw.txt"):
    p = tmp_path / name
    p.write_text("\n".join(rows) + "\n")
    return p


def test_counter_keeps_frequent_keys_by_count_then_key_and_caps():
    c = VocabularyCounter()
    c.add(np.array([5, 5, 5, 7, 7, 9, 3, 3], np.uint64))
    c.add(np.array([9, 11], np.uint64))
    v = c.build(min_count=2, max_size=100)
    # 5 (3x) first, then 3, 7, 9 (2x each) by key; 11 (once) is dropped.
    assert v.size == 2 + 4
    assert dict(zip(v.keys.tolist(), v.ids.tolist())) == {5: 2, 3: 3, 7: 4, 9: 5}
    assert v.lookup(np.array([5, 11, 3, 12345], np.uint64)).tolist() == [2, OOV_ID, 3, OOV_ID]
    capped = c.build(min_count=1, max_size=4)  # missing + OOV + the 2 most frequent
    assert capped.size == 4 and sorted(capped.keys.tolist()) == [3, 5]


def test_category_only_in_test_split_maps_to_oov(tmp_path, cache_dir):
    """Issue 3, bad input 4: 8 train rows, 1 validation, 1 test; C1 'aaaaaaaa' only in test."""
    rows = [base_row(label=str(i % 2), cats=cats("0000000a" if i < 6 else "0000000b")) for i in range(8)]
    rows += [base_row(cats=cats("0000000b")), base_row(cats=cats("aaaaaaaa"))]
    rows[2] = base_row(cats=[""] + CATS[1:])  # a missing value stays 0
    p = prepare(ConversionSpec(CRITEO, write(tmp_path, rows), 1000, mapping="vocabulary"))
    assert p.rows == {"train": 8, "validation": 1, "test": 1}
    train, val, test = (pq.read_table(p.files[s]).column("C1").to_pylist() for s in ("train", "validation", "test"))
    # 0000000a: 5 rows in train -> id 2; 0000000b: 2 rows -> id 3; missing -> 0.
    assert train == [2, 2, 0, 2, 2, 2, 3, 3]
    assert val == [3] and test == [OOV_ID]
    assert p.num_embeddings[0] == 4  # missing, OOV, two values
    assert p.num_embeddings[1] == 3  # C2 holds one value
    m = json.loads((p.directory / "manifest.json").read_text())
    assert m["num_embeddings"] == p.num_embeddings
    assert m["categorical_mapping"]["vocabulary_size"]["C1"] == 4 and m["categorical_mapping"]["oov_id"] == 1
    assert m["categorical_mapping"]["distinct_train_values"]["C1"] == 2


def test_min_count_and_table_cap(tmp_path, cache_dir):
    rows = [base_row(cats=cats(f"{1 + i % 3:08x}" if i < 7 else "00000009")) for i in range(10)]
    raw = write(tmp_path, rows)  # train C1: 1,2,3,1,2,3,1 (counts 3, 2, 2); 9 after train
    p = prepare(ConversionSpec(CRITEO, raw, 1000, split=(0.7, 0.0, 0.3), mapping="vocabulary", min_count=3))
    assert pq.read_table(p.files["train"]).column("C1").to_pylist() == [2, 1, 1, 2, 1, 1, 2]
    assert p.num_embeddings[0] == 3
    capped = prepare(ConversionSpec(CRITEO, raw, 4, split=(0.7, 0.0, 0.3), mapping="vocabulary"))  # 2 values fit
    c1 = pq.read_table(capped.files["train"]).column("C1").to_pylist()
    assert c1 == [2, 3, 1, 2, 3, 1, 2] and capped.num_embeddings[0] == 4
    for s in ("train", "test"):  # no id points past its table
        t = pq.read_table(capped.files[s])
        for j in range(26):
            assert max(t.column(f"C{j + 1}").to_pylist()) < capped.num_embeddings[j]


def test_scoring_reuses_the_training_vocabulary(tmp_path, cache_dir):
    train = prepare(
        ConversionSpec(
            CRITEO,
            write(tmp_path, [base_row(cats=cats("0000000a"))] * 4),
            100,
            split=(1.0, 0.0, 0.0),
            mapping="vocabulary",
        )
    )
    new = write(tmp_path, [base_row(cats=cats("0000000b")), base_row(cats=cats("0000000a"))], "new.txt")
    scored = prepare(
        ConversionSpec(
            CRITEO, new, 100, split=(1.0, 0.0, 0.0), mapping="vocabulary", vocabulary=train.directory / VOCABULARY_FILE
        )
    )
    assert pq.read_table(scored.files["train"]).column("C1").to_pylist() == [OOV_ID, 2]
    assert scored.num_embeddings == train.num_embeddings


def test_managed_features_get_no_vocabulary(tmp_path, cache_dir, monkeypatch):
    """data.managed.features under vocabulary mapping: the managed features take raw 63-bit
    keys, so the conversion counts no vocabulary for them and writes none; the other
    features' vocabularies, ids and table sizes are those of a conversion without managed
    features, the managed ones keep their configured rows, and scoring with the file agrees."""
    from recsys_dist.data import mapping as mp

    rows = [base_row(label=str(i % 2), cats=[f"{(i * 7 + j) % 5 + 1:08x}" for j in range(26)]) for i in range(40)]
    raw = write(tmp_path, rows)
    managed = [True, True] + [False] * 24
    made = []
    real_init = mp.VocabularyCounter.__init__
    monkeypatch.setattr(mp.VocabularyCounter, "__init__", lambda self: made.append(1) or real_init(self))
    some = prepare(ConversionSpec(CRITEO, raw, 50, mapping="vocabulary", managed=managed))
    assert len(made) == 24  # one counter per vocabulary feature, none for C1, C2
    plain = prepare(ConversionSpec(CRITEO, raw, 50, mapping="vocabulary"))
    assert some.num_embeddings[:2] == [50, 50] and some.num_embeddings[2:] == plain.num_embeddings[2:]
    vocab, plain_vocab = (pq.read_table(p.directory / VOCABULARY_FILE).to_pylist() for p in (some, plain))
    assert vocab == [r for r in plain_vocab if r["feature"] not in ("C1", "C2")]
    for s in ("train", "validation", "test"):
        a, b = pq.read_table(some.files[s]), pq.read_table(plain.files[s])
        assert a.drop(["C1", "C2"]).equals(b.drop(["C1", "C2"]))
    keys = np.array([(i * 7) % 5 + 1 for i in range(32)], np.uint64)  # C1's training keys (hex = key)
    assert pq.read_table(some.files["train"]).column("C1").to_pylist() == mp.managed_ids(keys).tolist()
    m = json.loads((some.directory / "manifest.json").read_text())["categorical_mapping"]
    assert m["managed"] == ["C1", "C2"]
    for field in ("vocabulary_size", "distinct_train_values"):
        assert list(m[field]) == [f"C{j}" for j in range(3, 27)]
    assert all(list(rates) == [f"C{j}" for j in range(3, 27)] for rates in m["oov_rate"].values())
    scored = prepare(
        ConversionSpec(
            CRITEO,
            raw,
            50,
            split=(1.0, 0.0, 0.0),
            mapping="vocabulary",
            vocabulary=some.directory / VOCABULARY_FILE,
            managed=managed,
        )
    )
    assert scored.num_embeddings == some.num_embeddings
    t = pq.read_table(scored.files["train"]).slice(0, 32)  # the training rows, as converted for training
    assert t.drop(["label"]).equals(pq.read_table(some.files["train"]).drop(["label"]))
