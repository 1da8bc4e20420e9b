"""Warnings of a conversion: shown when it runs, stored in its manifest and shown again when the
cached conversion is reused (one-class labels, an empty test split, out-of-vocabulary rates,
a multi-hot separator that looks wrong)."""

import json

import pytest

from recsys_dist.data.config import SchemaConfig
from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.criteo import CRITEO
from recsys_dist.data.formats.schema import SchemaFormat
from recsys_dist.data.splits import Split
from tests.conftest import base_row

CATS = [f"{i:08x}" for i in range(1, 27)]


@pytest.fixture
def new_process(monkeypatch):
    """Open the cache as a new process would (none of this process's checks remembered)."""

    def forget():
        monkeypatch.delenv("RECSYS_DIST_CHECKED_CACHE", raising=False)  # convert.cache.CHECKED_ENV, as documented

    forget()
    return forget


def manifest(p) -> dict:
    return json.loads((p.directory / "manifest.json").read_text())


def test_one_class_warning_is_repeated_when_the_cache_is_reused(tmp_path, cache_dir, new_process, capsys):
    """label_threshold on a 0/1 column: the warning came only from the first conversion; a
    second `preprocess` / `train` reusing the cache said nothing."""
    raw = tmp_path / "r.csv"
    raw.write_text("userId,click\n1,1\n2,0\n3,1\n")
    fmt = SchemaFormat(SchemaConfig(label="click", label_threshold=4.0, categorical=["userId"]))
    prepare(ConversionSpec(fmt, raw, 100, split=(1.0, 0.0, 0.0)))
    first = capsys.readouterr().err
    assert "all 3 training rows have label 0" in first and "remove label_threshold" in first
    new_process()
    p = prepare(ConversionSpec(fmt, raw, 100, split=(1.0, 0.0, 0.0)))
    again = capsys.readouterr().err
    assert again == first
    assert [w["kind"] for w in manifest(p)["warnings"]] == ["one_class"]
    # Scoring (warn_one_class=False) stays quiet about one class, reused or not.
    new_process()
    prepare(ConversionSpec(fmt, raw, 100, split=(1.0, 0.0, 0.0)), warn_one_class=False)
    assert capsys.readouterr().err == ""


def test_shown_once_per_run_not_again_by_the_ranks(tmp_path, cache_dir, new_process, capsys):
    """The launcher opens the cache and shows the warnings; rank 0, inheriting its environment,
    opens it again and stays quiet."""
    raw = tmp_path / "r.csv"
    raw.write_text("userId,click\n1,1\n2,0\n3,1\n")
    fmt = SchemaFormat(SchemaConfig(label="click", label_threshold=4.0, categorical=["userId"]))
    prepare(ConversionSpec(fmt, raw, 100, split=(1.0, 0.0, 0.0)))
    capsys.readouterr()
    prepare(ConversionSpec(fmt, raw, 100, split=(1.0, 0.0, 0.0)))
    assert capsys.readouterr().err == ""


def test_out_of_vocabulary_rates_in_the_manifest_and_a_warning(tmp_path, cache_dir, new_process, capsys):
    """Vocabulary mapping: C1's validation and test values never occur in train (100% OOV),
    C2's always do (0%)."""
    rows = [base_row(label=str(i % 2), cats=["0000000a"] + CATS[1:]) for i in range(8)]
    rows += [base_row(cats=["0000000b"] + CATS[1:]), base_row(cats=[""] + CATS[1:])]  # validation, test
    raw = tmp_path / "raw.txt"
    raw.write_text("\n".join(rows) + "\n")
    p = prepare(ConversionSpec(CRITEO, raw, 1000, split=(0.8, 0.1, 0.1), mapping="vocabulary"))
    err = capsys.readouterr().err
    rates = manifest(p)["categorical_mapping"]["oov_rate"]
    assert rates["validation"]["C1"] == 1.0 and rates["validation"]["C2"] == 0.0
    assert rates["test"]["C1"] is None  # the one test value of C1 is missing, not out of vocabulary
    assert rates["train"]["C1"] == 0.0
    assert (
        "in the validation split, most values of C1 100% (100% never in the training split) are out of vocabulary"
        in err
    )
    assert "Check that data.split" in err and "num_embeddings" not in err  # the cap left nothing out
    assert "C2" not in err and "in the test split" not in err
    new_process()
    prepare(ConversionSpec(CRITEO, raw, 1000, split=(0.8, 0.1, 0.1), mapping="vocabulary"))
    assert capsys.readouterr().err == err


def test_empty_test_split_warns(tmp_path, cache_dir, new_process, capsys):
    raw = tmp_path / "r.csv"
    raw.write_text("day,user,click\n" + "".join(f"{i % 3},{i},{i % 2}\n" for i in range(9)))
    fmt = SchemaFormat(SchemaConfig(label="click", categorical=["user"]))
    split = Split(by="time", column="day", thresholds=(1, 5))
    p = prepare(ConversionSpec(fmt, raw, 100, split=split))
    assert p.rows == {"train": 3, "validation": 6, "test": 0}
    err = capsys.readouterr().err
    assert "the test split is empty (train 3, validation 6, test 0 rows)" in err
    assert "thresholds[1] (5)" in err
    new_process()
    prepare(ConversionSpec(fmt, raw, 100, split=split))
    assert "the test split is empty" in capsys.readouterr().err
    prepare(ConversionSpec(fmt, raw, 100, split=(0.9, 0.1, 0.0)))  # no test split asked for: nothing to say
    assert "test split is empty" not in capsys.readouterr().err


@pytest.mark.parametrize("sep, other", [("|", ","), ("|", ";"), (",", "|")])
def test_multi_hot_separator_that_looks_wrong_warns(tmp_path, cache_dir, capsys, sep, other):
    raw = tmp_path / "r.csv"
    genres = ["Action", f"Action{other}Comedy", f"Drama{other}Comedy", f"Drama{other}Sci-Fi", "Drama"]
    raw.write_text("user,click,genres\n" + "".join(f'{i},{i % 2},"{g}"\n' for i, g in enumerate(genres * 4)))
    spec = SchemaConfig(label="click", categorical=["user"], multi_hot=["genres"], separator=sep)
    p = prepare(ConversionSpec(SchemaFormat(spec), raw, 100, split=(1.0, 0.0, 0.0)))
    err = capsys.readouterr().err
    assert f"multi-hot column genres: 0 of 20 values contain the separator {sep!r} (data.schema.separator)" in err
    assert f"but 12 contain {other!r}" in err and f"set data.schema.separator: {other!r}" in err
    assert [w["kind"] for w in manifest(p)["warnings"]] == ["separator"]
    # The right separator: no warning, and the bags have 2 elements.
    right = SchemaConfig(label="click", categorical=["user"], multi_hot=["genres"], separator=other)
    prepare(ConversionSpec(SchemaFormat(right), raw, 100, split=(1.0, 0.0, 0.0)))
    assert "separator" not in capsys.readouterr().err


def test_single_value_multi_hot_does_not_warn_and_a_space_is_the_last_guess(tmp_path, cache_dir, capsys):
    spec = SchemaConfig(label="click", categorical=["user"], multi_hot=["genres"])
    for values, said in (
        (["Drama", "Comedy"], None),  # one element per row: nothing to say
        (["Film Noir", "Drama"], "' '"),  # only a space in sight: said, as the weakest sign
        (["Action, Comedy", "Drama, Film Noir"], "','"),  # a comma beats the space
    ):
        raw = tmp_path / f"r{len(values[0])}.csv"
        raw.write_text("user,click,genres\n" + "".join(f'{i},{i % 2},"{values[i % 2]}"\n' for i in range(6)))
        prepare(ConversionSpec(SchemaFormat(spec), raw, 100, split=(1.0, 0.0, 0.0)))
        err = capsys.readouterr().err
        if said is None:
            assert "separator" not in err
        else:
            assert f"set data.schema.separator: {said}" in err
