"""Issue 40 item 9: how many training values each table gives a row of its own (a vocabulary cap
that leaves values out, hash collisions), printed by preprocess, stored in the manifest and the
preprocessing record, shown by `recsys-dist plan`, and the validation warning that names the
right cause."""

import json

import pytest
import yaml

from recsys_dist.cli import main as cli
from recsys_dist.config.loader import load_config
from recsys_dist.data.record import Preprocessing
from recsys_dist.data.resolve import data_format
from tests.cli import run_train
from tests.conftest import ROOT
from tests.unit.data.test_coverage import write_raw

MOVIELENS = ROOT / "configs" / "movielens_deepfm.yaml"


# ------------------------------------------------------------------- CLI, plan, record


def write_config(tmp_path, raw, sizes) -> str:
    cfg = {
        "data": {
            "format": "schema",
            "raw_path": str(raw),
            "schema": {"label": "click", "categorical": ["item", "user"]},
            "split": {"by": "time", "column": "t", "thresholds": [1, 2]},
            "categorical_mapping": "vocabulary",
            "num_embeddings": sizes,
            "cache_dir": str(tmp_path / "cache"),
        },
        "model": {"name": "deepfm", "embedding_dim": 8},
        "distributed": {"nproc_per_node": 1},
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def main(argv, capsys) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_preprocess_plan_and_record_show_the_coverage(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RECSYS_DIST_CHECKED_CACHE", raising=False)
    config = write_config(tmp_path, write_raw(tmp_path), [4, 100])
    code, out, err = main(["plan", "--config", config, "--world-size", "1"], capsys)
    assert code == 0, err
    assert "training values with a table row of their own: not known: the data is not converted yet" in out
    code, out, err = main(["preprocess", "--config", config, "--quiet"], capsys)
    assert code == 0 and "item 50.0% (50.0% left out by num_embeddings" in err
    code, out, err = main(["plan", "--config", config, "--world-size", "1"], capsys)
    assert code == 0, err
    lines = out[out.index("training values with a table row of their own (from ") :].splitlines()
    assert lines[1].split() == ["table", "rows", "train", "values", "distinct", "out", "of", "vocab"] + [
        "rows",
        "for",
        "95%",
        "rows",
        "for",
        "99%",
    ]
    assert lines[2].split() == ["item", "4", "200", "45", "50.0%", "!", "37", "45"]
    assert lines[3].split() == ["user", "12", "200", "10", "0.0%", "12", "12"]
    code, out, _ = main(["plan", "--config", config, "--world-size", "1", "--json"], capsys)
    plan = json.loads(out)["coverage"]
    assert plan["kind"] == "vocabulary" and plan["tables"]["item"]["outside_share"] == 0.5
    # The preprocessing record (written beside every checkpoint and export) carries the numbers.
    d = load_config(config).data
    entry = next((tmp_path / "cache").glob("schema-*/manifest.json")).parent
    manifest = json.loads((entry / "manifest.json").read_text())
    record = Preprocessing.describe(d, data_format(d), manifest["num_embeddings"], entry, manifest)
    assert record.record["categorical_mapping"]["coverage"] == plan["tables"]
    record.save(tmp_path)
    assert Preprocessing.load(tmp_path).record["categorical_mapping"]["coverage"]["item"]["cut_by_size"] == 0.5


def test_a_conversion_from_before_coverage_reads_as_unknown(tmp_path, capsys, monkeypatch):
    """An older cache entry (no coverage in its manifest): its training OOV rate is still
    shown and warned about, the suggested sizes are unknown, nothing fails."""
    monkeypatch.delenv("RECSYS_DIST_CHECKED_CACHE", raising=False)
    config = write_config(tmp_path, write_raw(tmp_path), [4, 100])
    assert main(["preprocess", "--config", config, "--quiet"], capsys)[0] == 0
    path = next((tmp_path / "cache").glob("schema-*/manifest.json"))
    m = json.loads(path.read_text())
    del m["categorical_mapping"]["coverage"]
    m["warnings"] = [w for w in m["warnings"] if w["kind"] != "coverage"]
    path.write_text(json.dumps(m))
    monkeypatch.delenv("RECSYS_DIST_CHECKED_CACHE", raising=False)
    code, _, err = main(["preprocess", "--config", config, "--quiet"], capsys)
    assert code == 0
    assert "item 50.0% (2 of 45 distinct values kept; sizes to suggest not counted)" in err
    assert "written by an older recsys_dist" in err
    code, out, _ = main(["plan", "--config", config, "--world-size", "1"], capsys)
    assert code == 0 and out.splitlines()[-2].split() == ["item", "4", "?", "45", "50.0%", "!", "?", "?"]


@pytest.mark.slow
def test_train_prints_the_coverage_once_and_pins_it_with_the_checkpoint(tmp_path):
    """`train` on a MovieLens template with movieId capped at 1,000 rows: the warning once (not
    per rank), and the checkpoint's preprocessing.json carries the numbers."""
    run_dir = tmp_path / "run"
    r = run_train(
        MOVIELENS,
        run_dir,
        "distributed.nproc_per_node=2",
        "train.progress_bar=false",
        "checkpoint.enabled=true",
        "train.max_steps=4",
        "data.num_embeddings=[200, 1000, 30]",
        tmp=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # 4,233 distinct movies in the 15,961 training rows; the 998 most frequent hold 66.1% of them.
    assert r.stderr.count("more than 1% of the training values are out of vocabulary") == 1
    assert (
        "in 1 of 3 tables, more than 1% of the training values are out of vocabulary and share its row 1, so the "
        "model cannot tell them apart: movieId 33.9% (33.9% left out by num_embeddings; 998 of 4,233 distinct values "
        "kept; in vocabulary: 95% at 3,437 rows, 99% at 4,076 rows)" in r.stderr
    )
    record = json.loads(next(run_dir.glob("checkpoints/step_*/preprocessing.json")).read_text())
    movie = record["categorical_mapping"]["coverage"]["movieId"]
    assert movie["suggested_num_embeddings"] == {"95%": 3437, "99%": 4076} and movie["train_values"] == 15961
