"""Symbolic links planted where recsys_dist writes are never written through (issue 40, item 8).

Every file a run, a publish or an export writes goes through ``recsys_dist.files``: whole files
are written under a new name and renamed over the link (which replaces the link itself), files
written in place (``.lock``, ``metrics.jsonl``) are opened with ``O_NOFOLLOW`` and a link, a
hard link or a FIFO there is refused with a message naming the path and the fix. Before, each
was opened through the link and its target truncated.
"""

from __future__ import annotations

import json

import yaml

import recsys_dist
from recsys_dist.checkpoint.run_dir import WRITTEN_FILES
from recsys_dist.cli.report import report
from recsys_dist.serve.export import export
from recsys_dist.serve.publish import load_published
from recsys_dist.serve.publish_callback import PublishCallback
from tests.conftest import QUICKSTART
from tests.unit.robustness import test_planted_links as unit_test_planted_links
from tests.unit.robustness.test_planted_links import (
    VICTIM_TEXT,
    _plain,
    _plant,
)

victim = unit_test_planted_links.victim  # the fixture, shared with tests.unit.robustness.test_planted_links

# Every file a run writes (the library's own list), and the name the marker was written under before its rename.
RUN_FILES = [*WRITTEN_FILES, "checkpoints/latest.tmp"]
EXPORT_FILES = ["model.safetensors", "config.yaml", "preprocessing.json"]


def test_a_run_publish_export_and_report_write_no_planted_link_target(tmp_path, victim, monkeypatch):
    monkeypatch.setenv("RECSYS_DIST_CACHE", str(tmp_path / "cache"))
    run, out = tmp_path / "run", tmp_path / "export"
    for name in RUN_FILES:
        _plant(run / name, victim)
    # The publish dir's manifest: a link to another (empty) manifest, which a publish read and then overwrote.
    other = victim.parent / "manifest.json"
    other.write_text(json.dumps({"format_version": 1, "latest": None, "versions": [], "dropped": []}))
    before = other.read_text()
    _plant(run / "publish" / "manifest.json", other)
    for name in EXPORT_FILES:
        _plant(out / name, victim)
    for name in ["serving.json", "model.torchscript.pt"]:
        _plant(tmp_path / "torchscript" / name, victim)
    _plant(run / "loss.png", victim)
    cfg = recsys_dist.load_config(
        QUICKSTART,
        [
            "data.num_rows=300",
            "distributed.nproc_per_node=1",
            "checkpoint.every_n_steps=3",
            "checkpoint.keep_best=true",
            "eval.every_n_steps=3",
            "publish.enabled=true",
            "publish.every_n_steps=3",
        ],
    )
    # resume auto: planted metrics.jsonl / checkpoints/ would otherwise read as a run already there
    with recsys_dist.Trainer(cfg, run, resume="auto", callbacks=[PublishCallback(cfg.publish, run)]) as trainer:
        summary = trainer.fit()
    assert victim.read_text() == VICTIM_TEXT and other.read_text() == before
    export(run, out)
    export(run, tmp_path / "torchscript", format="torchscript")
    report(run, plots=True)

    assert victim.read_text() == VICTIM_TEXT and other.read_text() == before
    for name in [*(n for n in RUN_FILES if not n.endswith(".tmp")), "publish/manifest.json"]:
        assert _plain(run / name), f"{name} is still a link"
    assert json.loads((run / "summary.json").read_text())["steps"] == summary["steps"] >= 6
    assert yaml.safe_load((run / "config.yaml").read_text())["publish"]["every_n_steps"] == 3
    assert json.loads((run / "plan.json").read_text()) and "\n" in (run / "plan.txt").read_text()
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {r["split"] for r in lines} >= {"train", "validation", "test"}
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{summary['steps']:08d}" and (run / "checkpoints" / latest / "meta.json").is_file()
    assert (run / "checkpoints" / (run / "checkpoints" / "best").read_text().strip()).is_dir()
    manifest = json.loads((run / "publish" / "manifest.json").read_text())
    assert [v["kind"] for v in manifest["versions"]][:2] == ["full", "delta"]
    assert load_published(run / "publish")[1] == manifest["latest"]
    for name in EXPORT_FILES:
        assert _plain(out / name), f"export {name} is still a link"
    assert json.loads((tmp_path / "torchscript" / "serving.json").read_text())
    assert _plain(tmp_path / "torchscript" / "model.torchscript.pt")
    assert _plain(run / "loss.png") and (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # no temporary file left anywhere
    leftovers = [p for p in tmp_path.rglob(".*.tmp") if "cache" not in p.parts]
    assert not leftovers, leftovers
