import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import config_from_dict, load_config
from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.avazu import AVAZU
from recsys_dist.data.formats.criteo import CRITEO
from recsys_dist.data.splits import Split, random_assign
from recsys_dist.errors import DataError
from recsys_dist.train.preflight import check_before_launch
from tests.conftest import ROOT, base_row
from tests.unit.data.test_avazu import HEADER, ROW


def criteo_file(path, n, first=0):
    # I1 = the row's global index, so every split's rows can be named.
    path.write_text(
        "\n".join(
            base_row(label=str(i % 2), dense=[str(i)] + [str(k) for k in range(2, 14)]) for i in range(first, first + n)
        )
        + "\n"
    )
    return path


def i1(p, s):
    return np.rint(np.expm1(pq.read_table(p.files[s]).column("I1").to_numpy())).astype(int).tolist()


def test_random_split_is_seeded_and_covers_every_row_once(tmp_path, cache_dir):
    raw = criteo_file(tmp_path / "raw.txt", 1000)
    split = Split(by="random", fractions=(0.8, 0.1, 0.1), seed=7)
    p = prepare(ConversionSpec(CRITEO, raw, 100, split=split))
    parts = {s: i1(p, s) for s in ("train", "validation", "test")}
    assert sorted(sum(parts.values(), [])) == list(range(1000))
    assert all(v == sorted(v) for v in parts.values())  # file order within each split
    assert 740 < len(parts["train"]) < 860 and 60 < len(parts["validation"]) < 140  # binomial around 80/10/10
    assert parts["validation"] != list(range(800, 900))  # not by position
    # The assignment is a function of (seed, row index) alone: blocks and reruns do not matter.
    whole = random_assign(7, (0.8, 0.1, 0.1), 0, 1000)
    assert np.array_equal(
        np.concatenate([random_assign(7, (0.8, 0.1, 0.1), 0, 300), random_assign(7, (0.8, 0.1, 0.1), 300, 700)]), whole
    )
    assert np.flatnonzero(whole == 1).tolist() == parts["validation"]
    other = prepare(ConversionSpec(CRITEO, raw, 100, split=Split(by="random", fractions=(0.8, 0.1, 0.1), seed=8)))
    assert i1(other, "validation") != parts["validation"]


def test_time_split_by_avazu_hour(tmp_path, cache_dir):
    hours = [14102100, 14102100, 14102223, 14102300, 14102200, 14102301]
    raw = tmp_path / "a.csv"
    raw.write_text(HEADER + "\n" + "\n".join(ROW.replace(",14102314,", f",{h},") for h in hours) + "\n")
    p = prepare(
        ConversionSpec(AVAZU, raw, 1000, split=Split(by="time", column="hour", thresholds=(14102200, 14102300)))
    )
    assert p.rows == {"train": 2, "validation": 2, "test": 2}  # < 22nd 00h, < 23rd 00h, the rest
    bad = tmp_path / "b.csv"
    bad.write_text(HEADER + "\n" + ROW + "\n" + ROW.replace(",14102314,", ",later,") + "\n")
    with pytest.raises(DataError, match=r"b.csv, data row 2, column hour: 'later'"):
        prepare(ConversionSpec(AVAZU, bad, 1000, split=Split(by="time", column="hour", thresholds=(1, 2))))


def test_split_by_files(tmp_path, cache_dir):
    train, val, test = (
        criteo_file(tmp_path / f"{n}.txt", k, first)
        for n, k, first in (("day0", 7, 0), ("day1a", 3, 100), ("day1b", 4, 200))
    )
    p = prepare(
        ConversionSpec(CRITEO, train, 100, split=Split(by="files", validation_path=str(val), test_path=str(test)))
    )
    assert p.rows == {"train": 7, "validation": 3, "test": 4}
    assert i1(p, "validation") == [100, 101, 102] and i1(p, "test") == [200, 201, 202, 203]


def test_split_config_forms_and_checks(tmp_path):
    data = {"raw_path": str(ROOT / "datasets/criteo_kaggle/dac_train_first10000.txt")}
    assert config_from_dict({"data": {**data, "split": [0.7, 0.2, 0.1]}}).data.split.fractions == (0.7, 0.2, 0.1)
    with pytest.raises(ConfigError, match="'hour' is not a raw column of criteo_tsv"):
        config_from_dict({"data": {**data, "split": {"by": "time", "column": "hour", "thresholds": [1, 2]}}})
    with pytest.raises(ConfigError, match="by time needs column and thresholds"):
        config_from_dict({"data": {**data, "split": {"by": "time"}}})
    with pytest.raises(ConfigError, match="summing to 1"):
        config_from_dict({"data": {**data, "split": {"by": "random", "fractions": [0.5, 0.1, 0.1]}}})
    with pytest.raises(ConfigError, match=r"\['seed_x'\]|data.split.seed_x: unknown key"):
        config_from_dict({"data": {**data, "split": {"by": "random", "seed_x": 1}}})
    # keys a split does not read: before, fractions under by: time and a seed under position were ignored
    time = {"by": "time", "column": "I1", "thresholds": [1, 2]}
    with pytest.raises(ConfigError, match=r"data.split: fractions only applies to by: position / random, not by: time"):
        config_from_dict({"data": {**data, "split": {**time, "fractions": [0.5, 0.25, 0.25]}}})
    with pytest.raises(ConfigError, match=r"data.split: seed only applies to by: random, not by: position"):
        config_from_dict({"data": {**data, "split": {"fractions": [0.5, 0.25, 0.25], "seed": 3}}})
    # a saved config lists both at their defaults whatever the split
    saved = {**time, "fractions": [0.8, 0.1, 0.1], "seed": 0}
    assert config_from_dict({"data": {**data, "split": saved}}).data.split.by == "time"
    # Paths of split files are relative to the config file, and must exist before launch.
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        yaml.safe_dump({"data": {**data, "split": {"by": "files", "validation_path": "v.txt", "test_path": "t.txt"}}})
    )
    cfg = load_config(cfg_file, check_files=False)
    assert cfg.data.split.validation_path == str(tmp_path / "v.txt")
    with pytest.raises(ConfigError, match=r"data.split.validation_path: file .*v.txt does not exist"):
        check_before_launch(resolve_job(cfg))
    with pytest.raises(ConfigError, match=r"data.split.validation_path: file .*v.txt does not exist"):
        load_config(cfg_file)


def test_a_list_of_raw_files_needs_split_by_files():
    with pytest.raises(ConfigError, match="a list of files is the training data of split.by: files"):
        config_from_dict({"data": {"raw_path": ["a.txt", "b.txt"]}, "model": {"name": "dlrm"}})


def test_a_list_of_raw_files_resolves_against_the_config_and_is_checked(tmp_path):
    (tmp_path / "d0.txt").write_text(base_row() + "\n")
    (tmp_path / "v.txt").write_text(base_row() + "\n")
    (tmp_path / "t.txt").write_text(base_row() + "\n")
    (tmp_path / "c.yaml").write_text(
        yaml.safe_dump(
            {
                "data": {
                    "raw_path": ["d0.txt", "d1.txt"],
                    "split": {"by": "files", "validation_path": "v.txt", "test_path": "t.txt"},
                },
                "model": {"name": "dlrm"},
            }
        )
    )
    cfg = load_config(tmp_path / "c.yaml", check_files=False)
    assert cfg.data.raw_path == [str(tmp_path / "d0.txt"), str(tmp_path / "d1.txt")]
    with pytest.raises(ConfigError, match=r"data.raw_path: file .*d1.txt does not exist"):
        check_before_launch(resolve_job(cfg))
    with pytest.raises(ConfigError, match=r"data.raw_path: file .*d1.txt does not exist"):
        load_config(tmp_path / "c.yaml")
