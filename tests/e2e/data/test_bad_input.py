"""Bad raw input: every line is a row or a counted bad line, and the error names the file,
line and column (cases that cannot be corpus text: gzip, bytes that are not UTF-8, Parquet)."""

import gzip

import numpy as np
import pytest

from recsys_dist.cli import main as cli
from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.criteo import CRITEO, read_chunks
from recsys_dist.data.text import count_rows
from recsys_dist.errors import DataError
from tests.conftest import QUICKSTART, base_row
from tests.unit.data.test_bad_input import manifest


def cli_run(argv, capsys) -> tuple[int, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out and "Exception ignored" not in err, err
    return code, err


# 4. a truncated compressed file
def test_truncated_gzip_is_a_data_error_everywhere(tmp_path, cache_dir, capsys):
    ok = tmp_path / "ok.txt.gz"
    ok.write_bytes(gzip.compress("".join(base_row(label=str(i % 2)) + "\n" for i in range(300)).encode()))
    bad = tmp_path / "t.txt.gz"
    bad.write_bytes(ok.read_bytes()[: len(ok.read_bytes()) // 2])  # like `head -c`
    with pytest.raises(DataError, match=r"t.txt.gz: cannot read the file \(.*\); a compressed file may be truncated"):
        count_rows(bad)
    with pytest.raises(DataError, match=r"t.txt.gz: cannot read the file"):
        list(read_chunks(str(bad)))
    code, err = cli_run(["preprocess", "--config", QUICKSTART, f"data.raw_path={bad}"], capsys)
    assert code == 1 and "t.txt.gz: cannot read the file" in err
    split = f"data.split={{by: files, validation_path: {bad}, test_path: {ok}}}"
    code, err = cli_run(["preprocess", "--config", QUICKSTART, f"data.raw_path={ok}", split], capsys)
    assert code == 1 and "t.txt.gz: cannot read the file" in err


# 7. bytes that are not UTF-8 text
def test_binary_garbage_is_one_clear_message(tmp_path, cache_dir, capsys):
    raw = tmp_path / "garbage.txt"
    raw.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)))
    code, err = cli_run(["preprocess", "--config", QUICKSTART, f"data.raw_path={raw}"], capsys)
    assert code == 1 and "garbage.txt, line 1: byte" in err and "is not UTF-8 text" in err
    assert "UnicodeDecodeError" not in err
    code, err = cli_run(["preprocess", "--config", QUICKSTART, f"data.raw_path={raw}", "data.on_bad_row=skip"], capsys)
    assert code == 1 and "every row (" in err and "was skipped as bad" in err and "garbage.txt, line 1: byte" in err
    # One bad line among good ones: skipped and counted.
    good = [base_row(label=str(i % 2)).encode() for i in range(10)]
    raw.write_bytes(b"\n".join(good[:4] + [b"0\t\xe9\xff" + good[0][3:]] + good[4:]) + b"\n")
    with pytest.raises(DataError, match=r"garbage.txt, line 5: byte 3 \(0xe9\) is not UTF-8 text"):
        prepare(ConversionSpec(CRITEO, raw, 100))
    m = manifest(prepare(ConversionSpec(CRITEO, raw, 100, split=(1.0, 0.0, 0.0), on_bad_row="skip")))
    assert m["rows_written"] == 10 and m["rows_skipped"] == 1
