"""``POST /score`` under ``data.schema.history.ties: file_order``: a request's candidates (a
user's rows at one later time) never see each other, on every route (in memory, objects and text
lines; the file route). Under file_order a file's rows of one time read each other in file
order, so a candidate read the candidates before it in the request (their items and actions)
and its score depended on which other candidates were sent and in which order."""

import json

import pytest

from recsys_dist.data.record import Preprocessing
from recsys_dist.errors import BadRequest
from recsys_dist.serve.export import LoadedModel
from recsys_dist.serve.inmemory import InMemoryScorer
from recsys_dist.serve.request_rows import score_rows
from recsys_dist.train.job import load_job
from tests.unit.serve.test_one_encoder import Recorder  # the stand-in model that keeps every batch

COLUMNS = ["userId", "movieId", "rating", "timestamp"]


def histories(batches, key: str) -> list[list[int]]:
    """Per real row (weight > 0), in order, the ids of sequence ``key``."""
    out = []
    for b in batches:
        keep = (b.weights > 0).tolist()
        lists = b.sparse_features[key].to_dense()
        out += [lst.tolist() for lst, kept in zip(lists, keep) if kept]
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ties")
    raw = tmp / "log.csv"
    raw.write_text("1,10,4,100\n1,11,3,100\n1,12,5,200\n2,10,1,50\n")
    config = {
        "data": {
            "format": "schema",
            "raw_path": str(raw),
            "cache_dir": str(tmp / "cache"),
            "split": [1.0, 0.0, 0.0],
            "schema": {
                "columns": COLUMNS,
                "header": False,
                "label": "rating",
                "label_threshold": 4.0,
                "categorical": ["userId", "movieId"],
                "history": {
                    "user": "userId",
                    "item": "movieId",
                    "time": "timestamp",
                    "max_length": 10,
                    "ties": "file_order",
                    "action": "rating",
                },
            },
            "num_embeddings": 1000,
        },
        "model": {"name": "din", "target_feature": "movieId", "embedding_dim": 4, "deep_layer_sizes": [4]},
    }
    job = load_job(json.loads(json.dumps(config)), "test config")
    return LoadedModel(job, Recorder(), "test", Preprocessing.describe(job.data, job.fmt, job.table_sizes))


PAST = [{"userId": 7, "movieId": m, "rating": r, "timestamp": t} for m, r, t in ((20, 4, 10), (21, 2, 10), (22, 5, 30))]
CANDIDATES = [{"userId": 7, "movieId": m, "timestamp": 40} for m in (30, 31, 32)]


def as_line(row: dict) -> str:
    """A row as a text line of the file (a candidate's rating, the label, given as 3)."""
    return ",".join(str(row.get(c, 3)) for c in COLUMNS)


@pytest.mark.parametrize("route", ["memory", "memory_lines"])
def test_candidates_do_not_see_each_other(loaded, route):
    rows = PAST + CANDIDATES
    loaded.model.batches.clear()
    if route == "file":
        score_rows(loaded, rows)
    else:
        InMemoryScorer(loaded)(rows if route == "memory" else [as_line(r) for r in rows])
    items, actions = histories(loaded.model.batches, "history"), histories(loaded.model.batches, "history_action")
    # every candidate reads the user's three past events, and no candidate
    assert [len(h) for h in items[3:]] == [3, 3, 3]
    assert items[3] == items[4] == items[5] and actions[3] == actions[4] == actions[5]
    assert len(set(items[2])) == 2  # the past row at 30 reads both rows at 10

    # the candidates alone, in the reverse order: the same inputs per candidate
    loaded.model.batches.clear()
    reverse = PAST + CANDIDATES[::-1]
    if route == "file":
        score_rows(loaded, reverse)
    else:
        InMemoryScorer(loaded)(reverse if route == "memory" else [as_line(r) for r in reverse])
    assert histories(loaded.model.batches, "history")[3:] == items[3:]


def test_the_file_route_reads_an_action_column_that_is_the_label(loaded):
    """``data.schema.columns`` (no header) whose label column is the history's action: the file
    route (``score_rows``, also the in-memory route's fallback for its error messages) writes and
    reads the rating as the action, giving the in-memory route's inputs; a row out of time order
    is named. Before, it wrote the rows without the label column and refused its own file
    (``columns ['rating'] named in data.schema are not in the file``)."""
    rows = PAST + CANDIDATES
    got = {}
    for route in ("memory", "file"):
        loaded.model.batches.clear()
        InMemoryScorer(loaded)(rows) if route == "memory" else score_rows(loaded, rows)
        got[route] = [histories(loaded.model.batches, k) for k in ("history", "history_action", "movieId")]
    assert got["file"] == got["memory"]
    assert len(set(got["file"][1][5])) == 3  # three past ratings, three action ids
    late = [*PAST, {**PAST[0], "timestamp": 5}]
    with pytest.raises(BadRequest, match=r"rows\[3\], column timestamp: 5 is earlier than 30"):
        InMemoryScorer(loaded)(late)


def test_a_request_without_the_history_user_is_refused(loaded):
    """Rows without the history's user column (or with an empty one) are a 400 naming the row
    and the column; before, they were scored as one user "" whose rows read each other."""
    rows = [{k: v for k, v in r.items() if k != "userId"} for r in PAST + CANDIDATES]
    with pytest.raises(BadRequest, match=r"rows\[0\], column userId: empty \(data.schema.history.user needs"):
        InMemoryScorer(loaded)(rows)
    rows = [*PAST, {**CANDIDATES[0], "userId": ""}]
    with pytest.raises(BadRequest, match=r"rows\[3\], column userId: empty"):
        score_rows(loaded, rows)


def test_a_request_whose_action_is_not_a_number_is_refused(loaded):
    """A history action (``data.schema.history.action``, here the rating) that is not a number is
    a 400 naming the row, the column and the fix, on both routes. Before, "four" became an action
    of its own that no training row held: the request scored it as the unknown action (HTTP 200)."""
    rows = [*PAST[:2], {**PAST[2], "rating": "four"}, *CANDIDATES]
    want = r"rows\[2\], column rating: 'four' is not a number \(.*action_values: text if the actions are categorical"
    with pytest.raises(BadRequest, match=want):
        InMemoryScorer(loaded)(rows)
    with pytest.raises(BadRequest, match=want):
        score_rows(loaded, rows)
    # a number in another form still scores
    loaded.model.batches.clear()
    InMemoryScorer(loaded)([*PAST[:2], {**PAST[2], "rating": "5.0"}, *CANDIDATES])
    assert len(set(histories(loaded.model.batches, "history_action")[5])) == 3
