"""``data.split.by: leave_last_out``: each user's last row (by time, ties in file order) is
test, the one before it validation, the rest train; users with fewer than 3 rows all train.
The converted held-out rows and their histories are the library's ``leave_last_out``
(``recsys_dist.models.next_item``) of the same log."""

import csv
import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import config_from_dict
from recsys_dist.data.config import SchemaConfig
from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.schema import SchemaFormat
from recsys_dist.data.mapping import hash_ids, text_keys
from recsys_dist.data.splits import LastEvents, Split, last_events_assign
from recsys_dist.errors import DataError
from recsys_dist.models.next_item import leave_last_out
from tests.conftest import ROOT

N = 1000
SPLIT = Split(by="leave_last_out", user="user", column="ts")
HISTORY = {"user": "user", "item": "item", "time": "ts", "max_length": 50, "ties": "file_order"}


def brute_force(users, times) -> tuple[list[int], list[int]]:
    """(validation rows, test rows): per user with 3+ rows, by (time, row), the last two."""
    val, test = [], []
    for u in set(users):
        rows = sorted((t, i) for i, (uu, t) in enumerate(zip(users, times)) if uu == u)
        if len(rows) >= 3:
            val.append(rows[-2][1])
            test.append(rows[-1][1])
    return sorted(val), sorted(test)


@pytest.mark.parametrize("block", [1, 7, 1000])
def test_last_events_finds_each_users_last_two_rows_in_any_order_and_blocks(block, monkeypatch):
    monkeypatch.setattr(LastEvents, "MIN_MERGE", 5)  # merge often: the kept entries meet later blocks
    rng = np.random.default_rng(block)
    users = rng.integers(0, 40, 600).astype(np.uint64)  # unsorted, interleaved
    times = rng.integers(0, 8, 600).astype(np.float64)  # many ties in time
    users[users == 3] = 4  # a user with no row; then users with exactly 1 and 2 rows
    users = np.append(users, np.array([100, 101, 101], np.uint64))
    times = np.append(times, [5.0, 7.0, 7.0])
    found = LastEvents()
    for lo in range(0, len(users), block):
        found.add(users[lo : lo + block], times[lo : lo + block], lo)
        assert len(found._kept[0]) <= 2 * len(np.unique(users[: lo + block]))  # at most two per user
    val, test = found.rows()
    assert (val.tolist(), test.tolist()) == brute_force(users.tolist(), times.tolist())
    assert not {600, 601, 602} & set(val.tolist() + test.tolist())  # 1 and 2 rows: all train
    where = np.concatenate([last_events_assign(val, test, lo, 50) for lo in range(0, 603, 50)])[:603]
    assert np.flatnonzero(where == 1).tolist() == val.tolist() and np.flatnonzero(where == 2).tolist() == test.tolist()


def ids(values):
    keys, present = text_keys(pa.array(values))
    out = hash_ids(keys, N)
    out[~present] = 0
    return out


def convert(tmp_path, text, split=SPLIT, history=HISTORY, **options):
    raw = tmp_path / "log.csv"
    raw.write_text(text)
    spec = SchemaConfig(label="click", categorical=["item"], history=history)
    p = prepare(ConversionSpec(SchemaFormat(spec), raw, N, split=split, **options))
    return p, {s: pq.read_table(p.files[s]).to_pydict() for s in ("train", "validation", "test")}


def test_ties_go_by_file_order_and_the_test_row_reads_the_validation_row(tmp_path, cache_dir):
    # a: m1 m2 | m3 m4 at one time (m4 later in the file: test; m3 validation); b: 2 rows; c: 1 row;
    # d: 3 rows; the users interleaved in the file.
    text = (
        "click,user,item,ts\n1,a,m1,1\n0,b,m5,3\n1,a,m2,2\n0,d,m10,1\n1,a,m3,4\n0,c,m6,1\n"
        "1,a,m4,4\n1,b,m7,3\n1,d,m8,5\n1,d,m9,9\n"
    )
    p, t = convert(tmp_path, text, history={**HISTORY, "max_length": 50}, on_bad_row="error")
    assert p.rows == {"train": 6, "validation": 2, "test": 2}
    m = dict(zip([f"m{i}" for i in range(1, 11)], ids([f"m{i}" for i in range(1, 11)]).tolist()))
    assert t["validation"]["item"] == [m["m3"], m["m8"]] and t["test"]["item"] == [m["m4"], m["m9"]]
    assert t["test"]["history"][0] == [m["m1"], m["m2"], m["m3"]]  # the tied validation item included
    assert t["validation"]["history"][0] == [m["m1"], m["m2"]]
    assert sorted(t["train"]["item"]) == sorted(m[k] for k in ("m1", "m2", "m5", "m7", "m6", "m10"))


def test_the_shipped_movielens_split_is_the_librarys_leave_last_out(tmp_path, cache_dir):
    """Every held-out row of the shipped config's data (133 users, 23 of them with their last
    two ratings at one second) is the library's target with the library's history (last 50)."""
    path = ROOT / "datasets" / "movielens" / "ratings_genres_first20000_by_time.csv"
    rows = list(csv.DictReader(path.open()))
    users, items, times = (np.array([int(r[k]) for r in rows]) for k in ("userId", "movieId", "timestamp"))
    spec = SchemaConfig(
        label="rating",
        label_threshold=4.0,
        categorical=["movieId"],
        history={"user": "userId", "item": "movieId", "time": "timestamp", "max_length": 50, "ties": "file_order"},
    )
    split = Split(by="leave_last_out", user="userId", column="timestamp")
    p = prepare(ConversionSpec(SchemaFormat(spec), path, N, split=split))
    lib = leave_last_out(users, items, times)
    assert p.rows == {"train": 20000 - 2 * len(lib.users), "validation": len(lib.users), "test": len(lib.users)}
    table_id = ids([str(x) for x in lib.items])  # dense id j -> the row hash gives raw item items[j - 1]
    for s in ("validation", "test"):
        t = pq.read_table(p.files[s]).to_pydict()
        # rows come in file order, which is by user here: the library's users are ascending
        assert t["movieId"] == table_id[lib.targets(s) - 1].tolist()
        assert t["history"] == [table_id[h - 1].tolist() for h in lib.histories(s, 50)]
    manifest = json.loads((p.directory / "manifest.json").read_text())
    assert manifest["split"]["by"] == "leave_last_out" and "file order" in manifest["split"]["rule"]


def test_bad_split_columns_and_configs_name_the_key(tmp_path, cache_dir):
    with pytest.raises(DataError, match=r"data.split.user 'user' is not a column of schema"):
        convert(tmp_path, "click,who,item,ts\n1,a,m1,1\n", history=None)
    with pytest.raises(DataError, match=r"data.split.column 'ts' is not a column of schema"):
        convert(tmp_path, "click,user,item,when\n1,a,m1,1\n", history=None)
    with pytest.raises(DataError, match=r"data row 2, column ts: 'soon' is not a number \(split.by leave_last_out"):
        convert(tmp_path, "click,user,item,ts\n1,a,m1,1\n1,a,m2,soon\n", history=None)
    data = {"format": "schema", "raw_path": "x.csv", "schema": {"label": "click", "categorical": ["item"]}}
    for split, message in (
        ({"by": "leave_last_out", "column": "ts"}, "by leave_last_out needs user"),
        ({"by": "time", "user": "u", "column": "ts", "thresholds": [1, 2]}, "user only applies to by: leave_last_out"),
        (
            {"by": "leave_last_out", "user": "other", "column": "ts"},
            "data.split.user: 'other' is not data.schema.history's user column 'user'",
        ),
        ({"by": "leave_last_out", "user": "user", "column": "ts"}, "data.schema.history.ties: exclude"),
    ):
        history = {**HISTORY, "ties": "exclude"} if "ties" in message else HISTORY
        with pytest.raises(ConfigError, match=message):
            config_from_dict({"data": {**data, "schema": {**data["schema"], "history": history}, "split": split}})
    # a format with known columns: checked with the config, before any conversion
    avazu = {"format": "avazu_csv", "raw_path": str(ROOT / "datasets" / "avazu" / "avazu_train_first8999.csv")}
    for split, message in (
        ({"by": "leave_last_out", "user": "userid", "column": "hour"}, "data.split.user: 'userid' is not a raw column"),
        ({"by": "leave_last_out", "user": "device_id", "column": "ts"}, "data.split.column: 'ts' is not a raw column"),
    ):
        with pytest.raises(ConfigError, match=message):
            config_from_dict({"data": {**avazu, "split": split}})
    ok = config_from_dict({"data": {**avazu, "split": {"by": "leave_last_out", "user": "device_id", "column": "hour"}}})
    assert ok.data.split.user == "device_id"


def test_skipped_rows_are_counted_alike_in_both_passes(tmp_path, cache_dir):
    # a bad row (a label that is no number) is left out of both passes: the row indices still agree
    text = "click,user,item,ts\n1,a,m1,1\nx,a,m2,2\n1,a,m3,3\n1,a,m4,4\n1,a,m5,5\n"
    p, t = convert(tmp_path, text, on_bad_row="skip")
    m3, m4, m5 = ids(["m3", "m4", "m5"]).tolist()
    assert p.rows == {"train": 2, "validation": 1, "test": 1}
    assert t["validation"]["item"] == [m4] and t["test"]["item"] == [m5] and t["test"]["history"][0][-2:] == [m3, m4]


def test_last_events_memory_is_per_user_not_per_row():
    """10x the rows of the same 20,000 users: the pass's peak stays within 1.2x (blocks of 10,000), and
    under 500 bytes a user."""

    def peak(rows: int) -> int:
        rng = np.random.default_rng(0)
        tracemalloc.start()
        found, top = LastEvents(), 0
        for lo in range(0, rows, 10_000):
            found.add(rng.integers(0, 20_000, 10_000).astype(np.uint64), rng.random(10_000), lo)
            top = max(top, tracemalloc.get_traced_memory()[1])
        found.rows()
        top = max(top, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        return top

    small, large = peak(300_000), peak(3_000_000)
    assert large < 1.2 * small and large < 500 * 20_000, (small, large)
