import json
import sys

_FULL_DISK = """
import resource, signal, sys
from recsys_dist.train.metrics_writer import MetricsError, MetricsWriter

w = MetricsWriter(sys.argv[1], enabled=True)
w.write(split="train", step=2, epoch=0, loss=0.5)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then a write past the limit fails with EFBIG
# The file may grow 17 bytes more: the next line's first 17 bytes reach it, then the write fails,
# as on a disk that fills mid-line (a short write, then an error on the rest).
resource.setrlimit(resource.RLIMIT_FSIZE, (len(open(sys.argv[1], "rb").read()) + 17, resource.RLIM_INFINITY))
try:
    w.write(split="train", step=4, epoch=0, loss=0.4, auc=0.75)
except MetricsError as err:
    print("refused:", err)
"""


def test_a_disk_that_fills_mid_line_leaves_only_whole_lines(tmp_path):
    """A real short write (the kernel writes part of the line, then refuses the rest): the
    buffered file kept the rest in its buffer, its truncate flushed it again, failed, and the
    torn line stayed in metrics.jsonl although the docs say it is removed."""
    import subprocess

    from tests.conftest import ROOT

    path = tmp_path / "metrics.jsonl"
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, str(path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "could not be written at step 4" in r.stdout, r.stdout
    text = path.read_text()
    assert text.endswith("\n") and [json.loads(line)["step"] for line in text.splitlines()] == [2]
