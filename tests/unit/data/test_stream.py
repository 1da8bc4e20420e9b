"""recsys_dist.data.stream and user histories (docs/online.md, "User histories"): under
``data.stream.histories: carry`` (the default) each partition's rows see their users' events of
the partitions before, exactly as if they had been one file; the state carried is saved and read
back exactly; a row earlier than its user's carried events is an error naming the line, which
leaves the carried state as it was; ``per_partition`` starts each partition afresh, with a warning."""

import io

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from recsys_dist.data.config import DataConfig, SchemaConfig
from recsys_dist.data.formats.history import UserHistory, copy_state, load_state, save_state
from recsys_dist.data.stream import convert_partition, history_note
from recsys_dist.errors import DataError
from tests.conftest import QUICKSTART, ROOT

HSTU = ROOT / "configs" / "movielens_hstu.yaml"
HEADER = "userId,movieId,rating,timestamp,genres\n"
COLUMNS = ("history", "history_action", "history_time")


def _data(path: str, stream: bool, config=HSTU, **extra) -> DataConfig:
    d = yaml.safe_load(config.read_text())["data"]
    if stream:
        for key in ("raw_path", "split", "min_count", "num_rows"):
            d.pop(key, None)
        d.update(categorical_mapping="hash", num_embeddings=2000, stream={"path": path, **extra})
        if "schema" in d and "history" in d["schema"]:
            d["schema"]["history"]["times"] = True
    else:
        d["raw_path"] = str(path)
    return DataConfig.model_validate(d)


def test_only_a_stream_deriving_histories_per_partition_says_they_start_afresh(tmp_path):
    """Before, nothing at run time said so; now carrying is the default and says nothing."""
    note = history_note(_data(str(tmp_path), stream=True, histories="per_partition"))
    assert note.startswith("data.stream with data.schema.history (history): each partition's histories start empty")
    assert "its userId's earlier rows of the same partition only" in note and "histories: carry" in note
    assert history_note(_data(str(tmp_path), stream=True)) is None  # carry (the default)
    assert history_note(_data(str(tmp_path / "log.csv"), stream=False)) is None  # a batch run: the whole file
    assert history_note(_data(str(tmp_path), stream=True, config=QUICKSTART)) is None  # no history
    with pytest.raises(ValueError, match="data.stream.histories: per_partition is not used without data.schema"):
        _data(str(tmp_path), stream=True, config=QUICKSTART, histories="per_partition")
    with pytest.raises(ValueError, match="histories"):
        _data(str(tmp_path), stream=True, histories="all")


def _rows(seed: int, n: int, users: int = 6):
    """``n`` rows of ``users`` users, non-decreasing times with many ties, some empty items."""
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, users, n).astype(np.uint64),
        rng.integers(1, 1 << 63, n, dtype=np.uint64),
        rng.random(n) > 0.1,
        np.sort(rng.integers(0, n // 3, n)).astype(np.float64),
        rng.integers(0, 5, n).astype(np.uint64),
    )


@pytest.mark.parametrize("ties", ["exclude", "file_order"])
def test_the_carried_state_round_trips_exactly_and_goes_on_as_one_pass(ties):
    """A state saved after the first 300 rows and read back gives the last 300 rows the
    histories that one pass over all 600 gives them (pending ties included); the saved file
    names a state of another history section, max_length or a damaged file."""
    spec = SchemaConfig(label="c", categorical=["i"], history={"user": "u", "item": "i", "time": "t", "max_length": 4})
    users, items, present, times, acts = _rows(0, 600)

    def rows(state, path, lo, hi):
        return state.rows(
            path, 1 + lo, users[lo:hi], items[lo:hi], present[lo:hi], times[lo:hi], spec.history, spec, acts[lo:hi]
        )

    whole = UserHistory(4, ties)
    want = rows(whole, "all", 0, 600)
    first = UserHistory(4, ties)
    rows(first, "p1", 0, 300)
    assert any(pending for _, _, pending in first.state.values())  # ties at the cut: carried too
    buf = io.BytesIO()
    save_state(first.state, 4, ties, "k", buf)
    loaded = load_state(io.BytesIO(buf.getvalue()), 4, ties, "k")
    flat = lambda s: {u: ([list(c) for c in com], at, p) for u, (com, at, p) in s.items()}  # noqa: E731
    assert flat(loaded) == flat(first.state)
    second = UserHistory(4, ties, carried=loaded)
    got = rows(second, "p2", 300, 600)
    start = int(want.lengths[:300].sum())
    for field in ("keys", "times", "actions"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field)[start:], err_msg=field)
    np.testing.assert_array_equal(got.lengths, want.lengths[300:])
    assert flat(second.state) == flat(whole.state)
    rows(second, "p2", 300, 600)  # a second pass over the partition starts from the carried state again
    assert flat(second.state) == flat(whole.state) and flat(second.carried) == flat(loaded)
    assert flat(copy_state(loaded)) == flat(loaded)
    with pytest.raises(ValueError, match="derived under data.schema.history k"):
        load_state(io.BytesIO(buf.getvalue()), 4, ties, "other")
    with pytest.raises(ValueError, match="derived with max_length 4"):
        load_state(io.BytesIO(buf.getvalue()), 5, ties, "k")
    with pytest.raises(ValueError, match="not a saved history state"):
        load_state(io.BytesIO(buf.getvalue()[: len(buf.getvalue()) // 2]), 4, ties, "k")


def _land(landing, name: str, lines: list[str]) -> None:
    (landing / name).write_text(HEADER + "".join(lines))


def test_partitions_carry_their_users_histories_as_one_file_and_late_rows_are_refused(tmp_path):
    """Three partitions converted in landing order, each from the state after the last, give
    the rows of the three concatenated into one file (items, actions, times); on main, user 1's
    first row of partition 2 had an empty history. A row earlier than its user's carried events
    is refused naming the line, leaving the state given as it was; per_partition starts afresh."""
    landing = tmp_path / "landing"
    landing.mkdir()
    rng = np.random.default_rng(1)
    lines = []
    for t in range(90):  # users 1..4, rows in time order, some at one time
        u = int(rng.integers(1, 5))
        lines.append(f"{u},{int(rng.integers(1, 40))},{int(rng.integers(1, 6))}.0,{1000 + t // 2},Drama\n")
    parts = ["a.csv", "b.csv", "c.csv"]
    for i, name in enumerate(parts):
        _land(landing, name, lines[i * 30 : (i + 1) * 30])
    _land(landing, "whole.csv", lines)
    d = _data(str(landing), stream=True)
    carried, tables = None, []
    for name in parts:
        part = convert_partition(d, name, tmp_path / "parts", carried)
        carried = part.histories
        tables.append(pq.read_table(part.prepared.files["train"]))
    whole = convert_partition(d, "whole.csv", tmp_path / "parts")
    one = pq.read_table(whole.prepared.files["train"])
    for c in COLUMNS:
        assert sum((t.column(c).to_pylist() for t in tables), []) == one.column(c).to_pylist(), c
    assert max(len(h) for h in tables[1].column("history").to_pylist()[:3]) > 0  # carried, not empty
    flat = lambda s: {u: ([list(c) for c in com], at, p) for u, (com, at, p) in s.items()}  # noqa: E731
    assert flat(carried) == flat(whole.histories)

    last_user, last_time = lines[-1].split(",")[0], int(lines[-1].split(",")[3])
    _land(landing, "late.csv", ["9,1,4.0,5,Drama\n", f"{last_user},2,4.0,{last_time - 1},Drama\n"])
    before = flat(carried)
    with pytest.raises(
        DataError,
        match=rf"late.csv, line 3, column timestamp: {last_time - 1} is earlier than {last_time} .* partition trained before",
    ):
        convert_partition(d, "late.csv", tmp_path / "parts", carried)
    assert flat(carried) == before  # a partition refused (quarantined) does not advance the state

    fresh = _data(str(landing), stream=True, histories="per_partition")
    part = convert_partition(fresh, parts[1], tmp_path / "parts", carried)
    assert part.histories is None
    got = pq.read_table(part.prepared.files["train"]).column("history").to_pylist()
    assert got[0] == [] and got != tables[1].column("history").to_pylist()


def test_a_resume_inside_a_partition_converts_it_again_for_the_state_after_it(tmp_path):
    """The entry of a partition converted before (a run stopped inside it) is converted again:
    reused, its rows would not be read and the state after it would be missing."""
    landing = tmp_path / "landing"
    landing.mkdir()
    _land(landing, "a.csv", ["1,1,4.0,1,Drama\n", "1,2,3.0,2,Drama\n"])
    d = _data(str(landing), stream=True)
    first = convert_partition(d, "a.csv", tmp_path / "parts")
    again = convert_partition(d, "a.csv", tmp_path / "parts")
    assert again.prepared.directory == first.prepared.directory and list(again.histories) == list(first.histories)
    assert [list(c) for c in again.histories[next(iter(again.histories))][0]][1] == [1.0]  # time 1 committed


def test_under_skip_a_history_error_names_the_rows_own_line(tmp_path):
    """data.on_bad_row: skip leaves bad lines out before the history is read: a late row, a row
    without a user or a time is then named by its file line (before: by its place among the rows
    kept, here line 4 where the row is on line 6, past a bad rating and a blank line)."""
    landing = tmp_path / "landing"
    landing.mkdir()
    _land(landing, "a.csv", ["1,1,4.0,10,Drama\n", "1,2,3.0,20,Drama\n"])
    d = _data(str(landing), stream=True).model_copy(update={"on_bad_row": "skip"})
    carried = convert_partition(d, "a.csv", tmp_path / "parts").histories
    skipped = ["2,1,four,5,Drama\n", "\n", "2,1,4.0,5,Drama\n"]  # lines 2 (a bad rating), 3 (blank), 4
    cases = {
        "1,3,4.0,15,Drama\n": r"line 5, column timestamp: 15 is earlier than 20",  # late: user 1 was at 20
        ",3,4.0,25,Drama\n": r"line 5, column userId: empty",
        "1,3,4.0,,Drama\n": r"line 5, column timestamp: '' is not a number",
        "1,3,4.0,soon,Drama\n": r"column timestamp, line 5: 'soon' is not a number",
        "1,3,x4,25,Drama\n": None,  # a bad rating: skipped, not an error
    }
    for n, (row, message) in enumerate(cases.items()):
        _land(landing, f"b{n}.csv", [*skipped, row, "3,1,4.0,30,Drama\n"])
        if message is None:
            assert convert_partition(d, f"b{n}.csv", tmp_path / "parts", carried).skipped == 3  # 2 bad, 1 blank
            continue
        with pytest.raises(DataError, match=rf"b{n}.csv, {message}"):
            convert_partition(d, f"b{n}.csv", tmp_path / "parts", carried)


def test_a_parquet_time_of_no_numbers_or_a_list_user_is_an_error_naming_the_column(tmp_path):
    """A Parquet timestamp column as data.schema.history.time (a Spark export's), or a list column
    as its user: a DataError naming the file, column and type (a stream quarantines the partition),
    also under data.on_bad_row: skip; before, pyarrow's ArrowNotImplementedError (a stream run died
    on every rank)."""
    import datetime

    import pyarrow as pa

    landing = tmp_path / "landing"
    landing.mkdir()
    day = datetime.datetime(2020, 1, 1)
    columns = {
        "userId": pa.array([1, 1]),
        "movieId": pa.array([1, 2]),
        "rating": pa.array([4.0, 3.0]),
        "timestamp": pa.array([10, 20]),
        "genres": pa.array(["Drama", "Drama"]),
    }
    pq.write_table(pa.table({**columns, "timestamp": pa.array([day, day], pa.timestamp("s"))}), landing / "t.parquet")
    pq.write_table(pa.table({**columns, "userId": pa.array([[1], [1]])}), landing / "u.parquet")
    d = _data(str(landing), stream=True)
    d = d.model_copy(update={"stream": d.stream.model_copy(update={"pattern": "*.parquet"})})
    for bad_row in ("error", "skip"):
        d = d.model_copy(update={"on_bad_row": bad_row})
        with pytest.raises(DataError, match=r"t.parquet, column timestamp: holds timestamp\[ms\] values, not numbers"):
            convert_partition(d, "t.parquet", tmp_path / "parts")
        with pytest.raises(DataError, match=r"u.parquet, column userId: a list column \(list<element: int64>\)"):
            convert_partition(d, "u.parquet", tmp_path / "parts")


def test_a_partition_of_a_header_alone_must_name_the_columns(tmp_path):
    """A file without rows is an empty partition, consumed; but its one line must be the header:
    a row written without one (a one-row file) or a header of other columns is malformed (a
    DataError naming the file, quarantined and retried once fixed). Before, such a file was
    consumed as empty: the row lost, exit 0; two such rows were refused."""
    import pyarrow as pa

    landing = tmp_path / "landing"
    landing.mkdir()
    (landing / "row.csv").write_text("1,1,4.0,10,Drama\n")
    (landing / "other.csv").write_text("user,movie,rating,ts,genres\n")
    (landing / "header.csv").write_text(HEADER)
    pq.write_table(pa.table({"user": pa.array([], pa.int64())}), landing / "other.parquet")
    d = _data(str(landing), stream=True)
    for name, found in (("row.csv", r"header: \['1', '1'"), ("other.csv", r"header: \['user'")):
        with pytest.raises(DataError, match=rf"{name}: columns .* named in data.schema are not in the file \({found}"):
            convert_partition(d, name, tmp_path / "parts")
    d = d.model_copy(update={"stream": d.stream.model_copy(update={"pattern": "*"})})
    with pytest.raises(DataError, match=r"other.parquet: columns .* not in the file \(Parquet schema: \['user'\]\)"):
        convert_partition(d, "other.parquet", tmp_path / "parts")
    assert convert_partition(d, "header.csv", tmp_path / "parts").rows == 0  # a header alone: empty
