"""The conversion cache: a damaged or incomplete entry is found when opened and converted again,
two processes converting the same data convert it once, and a reused entry repeats the
warnings of its conversion."""

import json
import os
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from recsys_dist.cli import main as cli
from recsys_dist.data.convert import cache
from tests.conftest import QUICKSTART, ROOT
from tests.unit.data import test_cache as unit_test_cache

raw = unit_test_cache.raw  # the fixture, shared with tests.unit.data.test_cache


def test_damage_is_reported_by_preprocess_and_the_entry_rebuilt(tmp_path, cache_dir, capsys):
    """Through the CLI: the run that follows the damage converts again and succeeds."""
    argv = ["preprocess", "--config", str(QUICKSTART), "data.num_rows=400"]
    assert cli.main(argv) == 0
    manifest = next(cache_dir.glob("criteo-*/manifest.json"))
    m = json.loads(manifest.read_text())
    assert m["integrity"]["algorithm"] == cache.CHECKSUM
    assert set(m["integrity"]["files"]) == {"train.parquet", "validation.parquet", "test.parquet"}
    f = manifest.parent / "train.parquet"
    data = bytearray(f.read_bytes())
    data[100:400] = bytes(300)
    f.write_bytes(bytes(data))
    capsys.readouterr()
    os.environ.pop("RECSYS_DIST_CHECKED_CACHE", None)  # a new `recsys-dist` process
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert f"{f}: its " in err and "checksum differs" in err and "train 320, validation 40, test 40" in out
    assert pq.read_table(f).num_rows == 320


_RACE = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from recsys_dist.data import convert
    from recsys_dist.data.convert import passes
    from recsys_dist.data.formats.criteo import CRITEO

    real, calls = passes.convert_rows, []

    def slow(*args, **kw):  # a conversion long enough for the other process to arrive meanwhile
        calls.append(1)
        time.sleep(2)
        return real(*args, **kw)

    passes.convert_rows = slow
    ready = Path(sys.argv[2])
    (ready / str(os.getpid())).touch()
    while len(list(ready.iterdir())) < 2:  # both processes start converting together
        time.sleep(0.01)
    p = convert.prepare(convert.ConversionSpec(CRITEO, sys.argv[1], 1000, cache_dir=sys.argv[3]))
    print(json.dumps({"converted": len(calls), "dir": str(p.directory), "rows": p.rows}))
    """
)


@pytest.mark.slow
def test_two_processes_converting_the_same_file_convert_it_once(raw, tmp_path):
    """Two `preprocess` / `train` runs of one raw file at once: the slower one died with
    FileNotFoundError on the shared temporary name; now it waits for the first and reuses its
    result."""
    ready = tmp_path / "ready"
    ready.mkdir()
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RECSYS_DIST_CHECKED_CACHE", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE, str(raw), str(ready), str(cache)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert sorted(g["converted"] for g in got) == [0, 1]
    assert got[0]["dir"] == got[1]["dir"] and got[0]["rows"] == got[1]["rows"] == {
        "train": 240,
        "validation": 30,
        "test": 30,
    }
    assert "waiting for it to finish" in "".join(err for _, err in results)
    entry = cache / os.path.basename(got[0]["dir"])
    assert sorted(f.name for f in entry.iterdir()) == [
        "manifest.json",
        "test.parquet",
        "train.parquet",
        "validation.parquet",
    ]  # no temporary file left
    assert (cache / f"{entry.name}.lock").is_file()
    assert pq.read_table(entry / "train.parquet").num_rows == 240
