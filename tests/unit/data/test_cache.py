"""The conversion cache: a damaged or incomplete entry is found when opened and converted again,
two processes converting the same data convert it once, and a reused entry repeats the
warnings of its conversion."""

import json
import shutil

import pyarrow.parquet as pq
import pytest

from recsys_dist.data import convert
from recsys_dist.data.convert import ConversionSpec, cache, manifest, prepare
from recsys_dist.data.formats.criteo import CRITEO
from recsys_dist.errors import DataError
from tests.conftest import CRITEO_SAMPLE


@pytest.fixture
def raw(tmp_path):
    p = tmp_path / "raw.txt"
    p.write_text("".join(CRITEO_SAMPLE.read_text().splitlines(keepends=True)[:300]))
    return p


@pytest.fixture
def new_process(monkeypatch):
    """Open the cache as a new process would (none of this process's checks remembered)."""

    def forget():
        monkeypatch.delenv("RECSYS_DIST_CHECKED_CACHE", raising=False)  # convert.cache.CHECKED_ENV, as documented

    forget()
    return forget


def tables(p) -> dict:
    return {s: pq.read_table(p.files[s]) for s in ("train", "validation", "test")}


def test_damaged_cached_file_is_named_and_converted_again(raw, cache_dir, new_process, capsys):
    """Zero bytes written into the middle of a cached file (same size): reading it failed
    mid-epoch with 'Unexpected end of stream' naming no file; now the next prepare names the
    file and converts again."""
    p = prepare(ConversionSpec(CRITEO, raw, 1000))
    before = tables(p)
    f = p.files["train"]
    data = bytearray(f.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 2000] = bytes(2000)
    f.write_bytes(bytes(data))
    capsys.readouterr()
    new_process()
    again = prepare(ConversionSpec(CRITEO, raw, 1000))
    err = capsys.readouterr().err
    assert f"{f}: its " in err and "checksum differs" in err and f"converting {raw} again" in err
    assert again.directory == p.directory
    assert all(tables(again)[s].equals(before[s]) for s in before)


def test_missing_or_truncated_split_file_is_converted_again(raw, cache_dir, new_process, capsys):
    p = prepare(ConversionSpec(CRITEO, raw, 1000))
    before = tables(p)
    p.files["test"].unlink()
    new_process()
    again = prepare(ConversionSpec(CRITEO, raw, 1000))
    assert f"{p.files['test']}: the file is missing" in capsys.readouterr().err
    assert tables(again)["test"].equals(before["test"])
    v = p.files["validation"]
    size = v.stat().st_size
    v.write_bytes(v.read_bytes()[:-10])
    new_process()
    again = prepare(ConversionSpec(CRITEO, raw, 1000))
    assert f"{v}: {size - 10:,} bytes where the manifest records {size:,}" in capsys.readouterr().err
    assert tables(again)["validation"].equals(before["validation"])


@pytest.mark.parametrize("text", ["[1, 2]", '"train.parquet"', '{"rows": 1, "categorical_mapping": [1]}'])
def test_a_manifest_that_is_json_but_not_a_conversions_object_is_named(raw, cache_dir, new_process, capsys, text):
    """A manifest.json that is JSON but not an object (or holds a list where an object goes)
    stopped prepare with a bare AttributeError; now it is named and the entry converted again."""
    p = prepare(ConversionSpec(CRITEO, raw, 1000))
    before = tables(p)
    path = p.directory / "manifest.json"
    path.write_text(text)
    capsys.readouterr()
    new_process()
    again = prepare(ConversionSpec(CRITEO, raw, 1000))
    assert f"{path}: not a readable manifest" in capsys.readouterr().err
    assert all(tables(again)[s].equals(before[s]) for s in before)


def test_a_checked_entry_is_not_read_again_by_the_ranks_it_starts(raw, cache_dir, new_process, monkeypatch):
    """The process that opens the cache before the ranks start reads every file; a rank (which
    inherits its environment) only compares sizes, unless a file was written since."""
    p = prepare(ConversionSpec(CRITEO, raw, 1000))  # the conversion checksums what it wrote
    calls = []
    real = cache._checksums
    monkeypatch.setattr(cache, "_checksums", lambda paths, alg: calls.append(len(paths)) or real(paths, alg))
    prepare(ConversionSpec(CRITEO, raw, 1000))
    assert calls == []  # a rank after the launcher's check
    new_process()
    prepare(ConversionSpec(CRITEO, raw, 1000))
    assert calls == [3]  # a new process reads every file
    f = p.files["test"]
    f.write_bytes(f.read_bytes())  # written since: read again
    prepare(ConversionSpec(CRITEO, raw, 1000))
    assert calls == [3, 3]


def test_a_cache_entry_of_recsys_dist_0_1_is_refused_naming_the_fix(raw, cache_dir, new_process, capsys):
    """recsys_dist 0.1.0 wrote manifests without cache_format, "integrity" (checksums) or, with
    one file per split, "files"; they were once checked and completed in place. The cache format
    is part of the key, so such an entry is never looked up again; one found where a key leads
    (here: put there by hand) is refused, naming the entry and the fix, and left as it is."""
    p = prepare(ConversionSpec(CRITEO, raw, 1000))
    path = p.directory / "manifest.json"
    m = json.loads(path.read_text())
    assert m["cache_format"] == convert.CACHE_FORMAT == 2
    old = {k: v for k, v in m.items() if k not in ("cache_format", "integrity", "files")}
    path.write_text(json.dumps(old))
    new_process()
    with pytest.raises(DataError) as e:
        prepare(ConversionSpec(CRITEO, raw, 1000))
    assert str(e.value) == (
        f"{p.directory}: this conversion was written by an older recsys_dist (cache format 1; this one reads "
        f"format 2 only): re-run the conversion: delete {p.directory}"
    )
    assert json.loads(path.read_text()) == old and p.files["train"].is_file()  # nothing rebuilt over it
    # Deleting it, as the message says, converts again: the same rows.
    shutil.rmtree(p.directory)
    again = prepare(ConversionSpec(CRITEO, raw, 1000))
    assert again.directory == p.directory and pq.read_table(again.files["train"]).num_rows == 240


def test_the_cache_key_names_every_option_and_the_format(raw, cache_dir, monkeypatch):
    """0.1.0 left default options out of the key (so that its first keys stayed valid); now every
    option is in it, and a new cache format gives new keys (older entries are never reused)."""
    first = prepare(ConversionSpec(CRITEO, raw, 1000)).directory.name
    monkeypatch.setattr(manifest, "CACHE_FORMAT", 3)
    assert prepare(ConversionSpec(CRITEO, raw, 1000)).directory.name != first


@pytest.mark.parametrize("managed", [None, ["C1"]], ids=["vocabulary", "vocabulary_and_managed_C1"])
def test_scoring_looks_up_the_entry_the_conversion_wrote(raw, cache_dir, managed):
    """A checkpoint without its preprocessing record finds its training conversion by the
    entry's name, computed as the conversion computes it. Scoring computed the name itself and
    left out ``data.managed.features``, so it missed the entry of a vocabulary run with
    managed features."""
    from recsys_dist.data.config import DataConfig
    from recsys_dist.data.resolve import cached_conversion, prepare_from_config
    from recsys_dist.serve.score_inputs import training_conversion

    section = {"format": "criteo_tsv", "raw_path": str(raw), "num_embeddings": 1000}
    section["categorical_mapping"] = "vocabulary"
    if managed:
        section["managed"] = {"features": managed, "eviction_interval": 10}
    d = DataConfig.model_validate(section)
    prepared = prepare_from_config(d)
    assert prepared.directory.name.startswith("criteo-")
    assert cached_conversion(d) == (prepared.directory, "")
    assert training_conversion(d) == prepared.directory


def test_a_conversion_is_one_spec_built_once_from_the_section(raw, cache_dir):
    """``prepare`` takes one ``ConversionSpec`` (it took 14 parameters, and the data section was
    unpacked into them at each of its callers): ``conversion_spec`` builds it from the section;
    the entry it names is the one ``prepare`` writes, and a field changed names another."""
    import dataclasses

    from recsys_dist.data.config import DataConfig
    from recsys_dist.data.convert import ConversionSpec, entry_path, prepare
    from recsys_dist.data.formats.criteo import CRITEO
    from recsys_dist.data.resolve import conversion_spec, prepare_from_config

    d = DataConfig.model_validate(
        {"format": "criteo_tsv", "raw_path": str(raw), "num_embeddings": 1000, "num_rows": 200, "on_bad_row": "skip"}
    )
    spec = conversion_spec(d)
    assert spec == ConversionSpec(
        spec.fmt, str(raw), 1000, d.split, num_rows=200, on_bad_row="skip", managed=[False] * 26
    )
    assert spec.fmt.name == "criteo_tsv" and spec.fmt.fingerprint == CRITEO.fingerprint
    converted = prepare(spec)
    assert sum(converted.rows.values()) == 200
    assert entry_path(spec) == converted.directory == prepare_from_config(d).directory
    assert entry_path(dataclasses.replace(spec, num_rows=100)) != converted.directory
    with pytest.raises(TypeError):
        prepare(CRITEO, raw, 1000)  # the format, files and sizes are the spec's
