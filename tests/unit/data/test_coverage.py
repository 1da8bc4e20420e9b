"""Issue 40 item 9: how many training values each table gives a row of its own (a vocabulary cap
that leaves values out, hash collisions), printed by preprocess, stored in the manifest and the
preprocessing record, shown by `recsys-dist plan`, and the validation warning that names the
right cause."""

import hashlib
import json

import numpy as np
import pytest

from recsys_dist.data.config import SchemaConfig
from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.convert.manifest import table_coverage
from recsys_dist.data.coverage import KeySketch, expected_collided_share, hash_size_for, mix64
from recsys_dist.data.formats.schema import SchemaFormat
from recsys_dist.data.splits import Split

# Training rows (t=0): item a x60, b x40, c x30, d x20, e x10 and 40 values seen once: 200
# values, 45 distinct. A vocabulary of 4 rows keeps a and b (100 values): 50.0% out of it.
# 95% (190 values) needs a..e (160) and 30 singletons: 35 keys, 37 rows; 99% (198): 43 keys, 45 rows.
ITEMS = ["a"] * 60 + ["b"] * 40 + ["c"] * 30 + ["d"] * 20 + ["e"] * 10 + [f"f{i}" for i in range(40)]
# Validation (t=1): 2 kept (a), 4 seen in training but left out by the cap (c), 4 never seen: 80% OOV.
VALIDATION = ["a", "a", "c", "c", "c", "c", "n1", "n2", "n3", "n4"]
TEST = ["a", "b"]
SPLIT = Split(by="time", column="t", thresholds=(1, 2))
SCHEMA = SchemaConfig(label="click", categorical=["item", "user"])


def write_raw(tmp_path):
    raw = tmp_path / "log.csv"
    rows = [(0, it) for it in ITEMS] + [(1, it) for it in VALIDATION] + [(2, it) for it in TEST]
    raw.write_text("t,item,user,click\n" + "".join(f"{t},{it},u{i % 10},{i % 2}\n" for i, (t, it) in enumerate(rows)))
    return raw


def coverage(p) -> dict:
    return json.loads((p.directory / "manifest.json").read_text())["categorical_mapping"]["coverage"]


def test_a_vocabulary_cap_is_counted_printed_and_stored(tmp_path, cache_dir, capsys, monkeypatch):
    """54.5% of the training rows went to the OOV row with no word (and the validation warning
    blamed the split): the share, its cause and the sizes that cover 95% / 99% are printed and
    stored; the validation warning says which values were cut by the cap and which are new."""
    raw = write_raw(tmp_path)
    fmt = SchemaFormat(SCHEMA)
    p = prepare(ConversionSpec(fmt, raw, [4, 100], split=SPLIT, mapping="vocabulary"))
    err = capsys.readouterr().err
    item = coverage(p)["item"]
    assert item == {
        "table_rows": 4,
        "train_values": 200,
        "distinct": 45,
        "outside_share": 0.5,
        "cut_by_size": 0.5,
        "below_min_count": 0.0,
        "suggested_num_embeddings": {"95%": 37, "99%": 45},
    }
    assert coverage(p)["user"]["outside_share"] == 0.0 and coverage(p)["user"]["suggested_num_embeddings"] == {
        "95%": 2 + 10,
        "99%": 2 + 10,
    }
    assert (
        f"{raw}: in 1 of 2 tables, more than 1% of the training values are out of vocabulary and share its row 1, "
        "so the model cannot tell them apart: item 50.0% (50.0% left out by num_embeddings; 2 of 45 distinct values "
        "kept; in vocabulary: 95% at 37 rows, 99% at 45 rows). Raise data.num_embeddings" in err
    )
    # The validation warning names both causes, not only the split.
    assert (
        "in the validation split, most values of item 80% (40% never in the training split, 40% left out by the "
        "size cap) are out of vocabulary" in err
    )
    assert "Check that data.split" in err and "Raise data.num_embeddings (the coverage warning" in err
    assert "Lower data.min_count" not in err and "in the test split" not in err
    # The suggested size does what it says: 95% of the training values in vocabulary at 37 rows.
    p37 = prepare(ConversionSpec(fmt, raw, [37, 100], split=SPLIT, mapping="vocabulary"))
    assert 1 - coverage(p37)["item"]["outside_share"] == 0.95
    assert (
        1
        - coverage(prepare(ConversionSpec(fmt, raw, [36, 100], split=SPLIT, mapping="vocabulary")))["item"][
            "outside_share"
        ]
        < 0.95
    )
    # A cached conversion repeats the warnings in a new process (train prints what preprocess did).
    capsys.readouterr()
    monkeypatch.delenv("RECSYS_DIST_CHECKED_CACHE", raising=False)
    prepare(ConversionSpec(fmt, raw, [4, 100], split=SPLIT, mapping="vocabulary"))
    assert capsys.readouterr().err == err


def test_min_count_and_the_cap_are_told_apart(tmp_path, cache_dir, capsys):
    raw = write_raw(tmp_path)
    p = prepare(ConversionSpec(SchemaFormat(SCHEMA), raw, [4, 100], split=SPLIT, mapping="vocabulary", min_count=2))
    item = coverage(p)["item"]
    # 40 singletons (20%) are below min_count; c, d, e (60 values, 30%) only lost to the cap.
    assert (item["outside_share"], item["cut_by_size"], item["below_min_count"]) == (0.5, 0.3, 0.2)
    assert item["suggested_num_embeddings"] == {"95%": None, "99%": None}  # min_count keeps at most 80%
    err = capsys.readouterr().err
    assert (
        "item 50.0% (30.0% left out by num_embeddings; 20.0% seen fewer than min_count 2 times; 2 of 45 distinct "
        "values kept; in vocabulary: 95% at no size with min_count 2, 99% at no size with min_count 2)" in err
    )


def _blake(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def test_hash_collisions_are_counted_exactly_and_sizes_suggested(tmp_path, cache_dir, capsys):
    raw = write_raw(tmp_path)
    n = 40
    p = prepare(ConversionSpec(SchemaFormat(SCHEMA), raw, n, split=SPLIT))
    # Independently: each training value's row, and whether another distinct value shares it.
    counts = {it: ITEMS.count(it) for it in dict.fromkeys(ITEMS)}
    rows = {it: 1 + _blake(it) % (n - 1) for it in counts}
    per_row = {r: sum(1 for x in rows.values() if x == r) for r in rows.values()}
    collided = sum(c for it, c in counts.items() if per_row[rows[it]] > 1)
    item = coverage(p)["item"]
    assert item["collided_share"] == collided / 200 and item["exact"] is True
    assert item["distinct"] == 45 and item["train_values"] == 200 and item["table_rows"] == n
    # The smallest size whose expected share of values with a row of their own is >= 95% / 99%.
    for pct in (95, 99):
        m = 1
        while (1 - 1 / m) ** 44 < pct / 100:
            m += 1
        assert item["suggested_num_embeddings"][f"{pct}%"] == m + 1
    assert collided == 132  # 66.0%: more than half share a row, so it is warned about
    assert "item 66.0% (45 distinct values hashed onto 39 table rows; a row of their own for 95% at about 860 rows" in (
        capsys.readouterr().err
    )
    # 45 values on 4 rows.
    p = prepare(ConversionSpec(SchemaFormat(SCHEMA), raw, [5, 100], split=SPLIT))
    share = coverage(p)["item"]["collided_share"]
    assert share > 0.5
    err = capsys.readouterr().err
    assert (
        f"in 1 of 2 tables, more than 50% of the training values share their hashed row with another value, so the "
        f"model cannot tell them apart: item {100 * share:.1f}% (45 distinct values hashed onto 4 table rows; a row of their own for "
        f"95% at about {hash_size_for(45, 95):,} rows, 99% at about {hash_size_for(45, 99):,} rows)" in err
    )


def test_stream_partitions_and_scoring_count_nothing(tmp_path, cache_dir, capsys):
    raw = write_raw(tmp_path)
    p = prepare(ConversionSpec(SchemaFormat(SCHEMA), raw, [5, 100], split=SPLIT), coverage=False)
    m = json.loads((p.directory / "manifest.json").read_text())
    assert "coverage" not in m["categorical_mapping"] and table_coverage(m) is None
    assert "share their hashed row" not in capsys.readouterr().err


def test_key_sketch_exact_up_to_k_then_an_estimate_with_exact_counts():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 2**63, 30_000, dtype=np.uint64)
    stream = np.repeat(keys, rng.integers(1, 4, len(keys)))
    rng.shuffle(stream)
    small = KeySketch(k=1 << 16)
    for part in np.array_split(stream, 7):
        small.add(part)
    assert small.distinct() == (30_000, True) and small.total == len(stream)
    sketch, a, b = KeySketch(k=1024), KeySketch(k=1024), KeySketch(k=1024)
    for i, part in enumerate(np.array_split(stream, 11)):
        sketch.add(part)
        (a if i % 2 else b).add(part)
    a.merge(b)  # two workers' sketches merge into the one sketch of all rows
    d, exact = sketch.distinct()
    assert not exact and abs(d - 30_000) < 0.1 * 30_000
    assert a.keys.tolist() == sketch.keys.tolist() and a.counts.tolist() == sketch.counts.tolist()
    assert a.distinct() == (d, False) and a.total == sketch.total == len(stream)
    # The kept keys are the smallest hashes, each with its exact count.
    u, c = np.unique(stream, return_counts=True)
    smallest = np.sort(u[np.argsort(mix64(u))[:1024]])
    assert sketch.keys.tolist() == smallest.tolist()
    assert sketch.counts.tolist() == c[np.searchsorted(u, smallest)].tolist()


def test_expected_share_and_sizes():
    assert expected_collided_share(1, 2) == 0.0
    assert expected_collided_share(2, 3) == pytest.approx(0.5)  # 2 values on 2 rows
    assert hash_size_for(1, 99) == 2
    d = 10_000
    n = hash_size_for(d, 95)
    assert 1 - expected_collided_share(d, n) >= 0.95 > 1 - expected_collided_share(d, n - 1)
    assert n == pytest.approx(d / -np.log(0.95), rel=1e-3)


def test_hash_coverage_of_splits_cut_again_is_marked_inexact(tmp_path, cache_dir):
    """on_bad_row: skip with a position split under hash: the splits are cut again after the keys
    were counted, so the counted rows are not exactly the training split's: `exact` says so."""
    raw = write_raw(tmp_path)
    lines = raw.read_text().splitlines(True)
    raw.write_text("".join(lines[:50] + ["1,x\n"] + lines[50:]))  # a short line, skipped
    fmt = SchemaFormat(SCHEMA)
    p = prepare(ConversionSpec(fmt, raw, 100, split=(0.8, 0.1, 0.1), on_bad_row="skip"))
    m = json.loads((p.directory / "manifest.json").read_text())
    assert m["rows_skipped"] == 1 and m["categorical_mapping"]["coverage"]["item"]["exact"] is False
    (tmp_path / "clean").mkdir()  # no bad row: nothing cut again, exact
    clean = prepare(ConversionSpec(fmt, write_raw(tmp_path / "clean"), 100, split=(0.8, 0.1, 0.1), on_bad_row="skip"))
    assert coverage(clean)["item"]["exact"] is True
