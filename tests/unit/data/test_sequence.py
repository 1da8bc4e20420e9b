"""data.schema.sequence (ordered list columns) and data.schema.history (user histories
derived from an interaction log in the streaming conversion)."""

import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_dist.data.config import SchemaConfig
from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.history import action_keys
from recsys_dist.data.formats.schema import SchemaFormat, UserHistory
from recsys_dist.data.mapping import hash_ids, text_keys
from recsys_dist.errors import DataError

N = 1000


def ids(values):
    keys, present = text_keys(pa.array(values))
    out = hash_ids(keys, N)
    out[~present] = 0
    return out.tolist()


def convert(tmp_path, text, **schema):
    raw = tmp_path / "log.csv"
    raw.write_text(text)
    spec = SchemaConfig(label="click", categorical=["item"], **schema)
    return pq.read_table(prepare(ConversionSpec(SchemaFormat(spec), raw, N, split=(1.0, 0.0, 0.0))).files["train"])


def test_sequence_column_keeps_the_most_recent_max_length(tmp_path, cache_dir):
    text = "click,item,seq\n1,x,a;b;c;d\n0,y,\n1,z,e\n0,x,f;;g\n"
    t = convert(tmp_path, text, sequence={"seq": {"max_length": 2, "separator": ";"}})
    assert t.schema.field("seq").type == pa.list_(pa.int64())
    a, b, c, d, e, f, g = ids(list("abcdefg"))
    # oldest first; truncated to the last 2; empty field = empty sequence; a plain value = one element;
    # empty elements dropped before truncating
    assert t.column("seq").to_pylist() == [[c, d], [], [e], [f, g]]


def expected_histories(rows, n):
    """Brute force: per row, items of the same user's rows with a strictly smaller time,
    ordered by (time, file order), the last n."""
    out = []
    for user, _item, time in rows:
        earlier = [(t, j, it) for j, (u, it, t) in enumerate(rows) if u == user and t < time]
        out.append([it for *_, it in sorted(earlier)][-n:] if n else [])
    return out


def test_history_sees_only_strictly_earlier_events_of_the_same_user(tmp_path, cache_dir):
    rng = np.random.default_rng(0)
    rows, clock = [], {}
    for _ in range(400):  # interleaved users, times non-decreasing per user, many ties
        u = f"u{rng.integers(6)}"
        clock[u] = clock.get(u, 100) + int(rng.integers(0, 3))  # +0: a tie with the previous event
        rows.append((u, f"m{rng.integers(30)}", clock[u]))
    text = "click,user,item,ts\n" + "".join(f"{i % 2},{u},{m},{t}\n" for i, (u, m, t) in enumerate(rows))
    t = convert(tmp_path, text, history={"user": "user", "item": "item", "time": "ts", "max_length": 4})
    got = t.column("history").to_pylist()
    want = [ids(h) if h else [] for h in expected_histories(rows, 4)]
    assert got == want
    # the no-leak rule, checked directly: nothing from the row itself, a tie, or later
    for i, (u, _m, ts) in enumerate(rows):
        allowed = (
            ids([it for uu, it, tt in rows if uu == u and tt < ts])
            if any(uu == u and tt < ts for uu, _, tt in rows)
            else []
        )
        assert set(got[i]) <= set(allowed)
    assert any(len(h) == 4 for h in got) and got[0] == []


def test_history_ties_and_first_rows(tmp_path, cache_dir):
    text = "click,user,item,ts\n1,a,m1,10\n0,a,m2,10\n1,b,m3,5\n1,a,m4,11\n0,a,m5,11\n1,a,m6,12\n"
    t = convert(tmp_path, text, history={"user": "user", "item": "item", "time": "ts", "max_length": 3})
    m1, m2, m4, m5 = ids(["m1", "m2", "m4", "m5"])
    assert t.column("history").to_pylist() == [[], [], [], [m1, m2], [m1, m2], [m2, m4, m5]]


def test_history_bad_input(tmp_path, cache_dir):
    hist = {"user": "user", "item": "item", "time": "ts", "max_length": 3}
    with pytest.raises(DataError, match=r"line 3, column ts: 9 is earlier than 10 .* non-decreasing ts order"):
        convert(tmp_path, "click,user,item,ts\n1,a,m1,10\n1,a,m2,9\n", history=hist)
    # Unix times (and fractions) exactly as written: this said "9.783e+08 is earlier than 9.783e+08"
    with pytest.raises(DataError, match=r"line 3, column ts: 978300759 is earlier than 978300760 "):
        convert(tmp_path, "click,user,item,ts\n1,a,m1,978300760\n1,a,m2,978300759\n", history=hist)
    with pytest.raises(DataError, match=r"line 3, column ts: 1234567.25 is earlier than 1234567.5 "):
        convert(tmp_path, "click,user,item,ts\n1,a,m1,1234567.5\n1,a,m2,1234567.25\n", history=hist)
    with pytest.raises(DataError, match=r"line 2, column ts: '' is not a number"):
        convert(tmp_path, "click,user,item,ts\n1,a,m1,\n", history=hist)
    with pytest.raises(DataError, match=r"columns \['ts'\] named in data.schema are not in the file"):
        convert(tmp_path, "click,user,item\n1,a,m1\n", history=hist)
    # a row without a user: before, every such row shared the history of one user ""
    with pytest.raises(DataError, match=r"line 3, column user: empty \(data.schema.history.user needs a user"):
        convert(tmp_path, "click,user,item,ts\n1,a,m1,1\n1, ,m2,2\n", history=hist)


def test_history_state_stays_flat_when_the_log_grows():
    """Memory is per user (N keys plus the current tie group), not per row: 10x the rows of
    the same users leave the peak within 1.2x."""
    h = SchemaConfig(label="c", categorical=["i"], history={"user": "u", "item": "i", "time": "t", "max_length": 8})

    def peak(batches: int) -> int:
        state = UserHistory(8)
        rng = np.random.default_rng(0)
        users = rng.integers(0, 200, 1000).astype(np.uint64)
        tracemalloc.start()
        for b in range(batches):
            items = rng.integers(0, 1 << 40, 1000).astype(np.uint64)
            times = np.full(1000, float(b))
            state.rows("f", 1 + b * 1000, users, items, np.ones(1000, bool), times, h.history, h)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(30), peak(300)
    assert large <= 1.2 * small, (small, large)


def number_text(v: str) -> str:
    return repr(float(v)) if v != "x" else v


def test_history_actions_and_times_match_a_brute_force(tmp_path, cache_dir):
    """``action`` and ``times``: per row, the same events as the items (strictly earlier, the last
    n, oldest first), each with its action's id and ``1 + floor(row time - event time)``."""
    rng = np.random.default_rng(1)
    rows, clock = [], {}
    for _ in range(300):
        u = f"u{rng.integers(5)}"
        clock[u] = clock.get(u, 1000.0) + float(rng.choice([0, 0.5, 7, 86400]))  # ties and fractions
        rows.append((u, f"m{rng.integers(20)}", clock[u], str(rng.choice(["1", "1.0", "2.5", "4", "4.00", "x"]))))
    text = "click,user,item,ts,rating\n" + "".join(f"1,{u},{m},{t!r},{r}\n" for u, m, t, r in rows)
    hist = {"user": "user", "item": "item", "time": "ts", "max_length": 4, "action": "rating", "times": True}
    t = convert(tmp_path, text, history={**hist, "action_values": "text"})  # "x": a categorical action
    assert t.column_names[-3:] == ["history", "history_action", "history_time"]
    items, actions, times = [], [], []
    for user, _item, time, _r in rows:
        earlier = sorted((tt, j) for j, (uu, _, tt, _) in enumerate(rows) if uu == user and tt < time)[-4:]
        items.append(ids([rows[j][1] for _, j in earlier]) if earlier else [])
        # numbers keyed by value ("4" and "4.00" one action), other text as it is
        actions.append(ids([number_text(rows[j][3]) for _, j in earlier]) if earlier else [])
        times.append([1 + int(np.floor(time - tt)) for tt, _ in earlier])
    assert t.column("history").to_pylist() == items
    assert t.column("history_action").to_pylist() == actions
    assert t.column("history_time").to_pylist() == times
    assert any(1 in r for r in times) and all(v >= 1 for r in times for v in r)  # a 0.5 s gap floors to 0


def test_an_action_that_is_not_a_number_is_refused(tmp_path, cache_dir):
    """``action_values: numbers`` (the default): a non-empty action that is not a number is an
    error naming the line, the column and the fix; before, it became an action of its own (at
    predict time one no training row held: the unknown action), silently. Empty: the action ""."""
    hist = {"user": "user", "item": "item", "time": "ts", "max_length": 4, "action": "rating"}
    text = "click,user,item,ts,rating\n1,a,m1,1,4\n1,a,m2,2,\n1,a,m3,3, four \n"
    with pytest.raises(DataError, match=r"log.csv, line 4, column rating: 'four' is not a number \(data.schema"):
        convert(tmp_path, text, history=hist)
    t = convert(tmp_path, text, history={**hist, "action_values": "text"})
    empty = hash_ids(text_keys(pa.array([""]))[0], N).tolist()  # "" is an action of its own
    assert t.column("history_action").to_pylist()[2] == ids(["4.0"]) + empty
    with pytest.raises(ValueError, match=r"action_values: only a history with an action column"):
        SchemaConfig(label="click", history={**hist, "action": None, "action_values": "text"})


def test_actions_beyond_float_precision_stay_apart_and_digit_separators_are_no_number(tmp_path, cache_dir):
    """Integer actions beyond 2^53 (e.g. hashed event-type ids under ``action_values: text``) are
    keyed by their digits: float64 merged 2^53 + 1 into 2^53, two actions into one, silently.
    The same value from a Parquet double (1e17) and an int64 column (10^17) is still one action.
    ``1_0`` is Python's digit separator, not a number any writer writes: before, it was read as
    10 (a typo taken as a rating); now ``numbers`` refuses it naming the line, ``text`` keeps it."""
    big = [str(2**53), str(2**53 + 1), str(2**53 + 2)]
    keys = action_keys(pa.array(big), numbers=True)
    assert len(set(keys.tolist())) == 3
    as_double, as_int = action_keys(pa.array([1e17])), action_keys(pa.array([10**17], pa.int64()))
    assert as_double.tolist() == as_int.tolist()
    small = action_keys(pa.array(["4", "4.00", "1e0", "1", "-0", "-0.0"]))  # below 2^53: keyed by repr(float)
    assert small.tolist() == text_keys(pa.array(["4.0", "4.0", "1.0", "1.0", "0.0", "0.0"]))[0].tolist()  # -0 is 0
    hist = {"user": "user", "item": "item", "time": "ts", "max_length": 4, "action": "rating"}
    text = "click,user,item,ts,rating\n1,a,m1,1,10\n1,a,m2,2,1_0\n1,a,m3,3,4\n"
    with pytest.raises(DataError, match=r"log.csv, line 3, column rating: '1_0' is not a number"):
        convert(tmp_path, text, history=hist)
    t = convert(tmp_path, text, history={**hist, "action_values": "text"})
    assert t.column("history_action").to_pylist()[2] == ids(["10.0", "1_0"])  # two actions, not 10 twice


def test_history_without_actions_and_times_converts_as_before(tmp_path, cache_dir):
    """The options off: the same columns and cache key as before they existed."""
    hist = {"user": "user", "item": "item", "time": "ts", "max_length": 4}
    spec = SchemaConfig(label="click", categorical=["item"], history=hist)
    fmt = SchemaFormat(spec)
    assert fmt.sparse_names == ["item", "history"] and fmt.value_names == []
    assert '"history": {"item": "item", "max_length": 4, "name": "history", "time": "ts", "user": "user"}' in (
        fmt.fingerprint
    )


def test_request_rows_carry_the_history_action_column():
    """Serving derives the history from the request's rows: they need the action column too."""
    from recsys_dist.data.formats.schema_request import schema_layout

    hist = {"user": "user", "item": "item", "time": "ts", "max_length": 4, "action": "rating", "times": True}
    spec = SchemaConfig(label="click", categorical=["item"], history=hist)
    layout = schema_layout(spec, lambda: None)
    assert [c for c in ("user", "item", "ts", "rating") if c in layout.columns] == ["user", "item", "ts", "rating"]


def test_rows_to_score_without_the_history_action_column_are_refused(tmp_path, cache_dir):
    """Rows to score (no label column) must still carry the history's columns, the action (here
    the label column, the rating) among them: a clear error, not a KeyError deep in the conversion."""
    from recsys_dist.data.formats.schema import UnlabelledSchemaFormat

    raw = tmp_path / "rows.csv"
    raw.write_text("user,item,ts\na,m1,1\na,m2,2\n")
    hist = {"user": "user", "item": "item", "time": "ts", "max_length": 4, "action": "rating"}
    spec = SchemaConfig(label="rating", label_threshold=4.0, categorical=["item"], history=hist)
    with pytest.raises(DataError, match=r"columns \['rating'\] named in data.schema are not in the file"):
        prepare(ConversionSpec(UnlabelledSchemaFormat(spec), raw, N, split=(1.0, 0.0, 0.0)))
