"""Resolve once, pass down: what one 2-rank ``recsys-dist train`` builds and checks, per process.

The command runs in a ``python -c`` wrapper that first replaces the counted functions with
ones that append a line ``{"pid", "rank", "what"}`` to a file on every call (a line per call,
because the ranks leave through ``os._exit``, which skips ``atexit``). The ranks fork from the
wrapper (``distributed.start_method: fork``, given here: a forkserver's ranks would not run the
wrapper's replacements), so they run the counting functions too.

Counted: RunConfig validation, preflight (``check_before_launch``) and its cross-section
pass (``section_problems``), model builds (the registered model's ``build``), ``feature_spec``
calls, and the planning path. Before the Job the launcher validated the YAML and
each rank validated it again (3 in all), ``section_problems`` ran 6 times and the model was
built on meta 5 times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

from tests.cli import ROOT
from tests.unit.train.test_resolve_once import QUICKSTART, TINY

WRAPPER = r"""
import json, os, sys

LOG = sys.argv[1]


def note(what):
    with open(LOG, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "rank": os.environ.get("RANK"), "what": what}) + "\n")


def count(module, name, what):
    fn = getattr(module, name)

    def counted(*args, **kwargs):
        note(what)
        return fn(*args, **kwargs)

    setattr(module, name, counted)


# Patched before any module that binds these names at import (the CLI, the trainer) is imported.
import recsys_dist.models.build as build
from recsys_dist.config.run import RunConfig
from recsys_dist.models.registry import get_model

count(build, "feature_spec", "feature_spec")
validate = RunConfig.model_validate.__func__
RunConfig.model_validate = classmethod(lambda cls, *a, **k: (note("config"), validate(cls, *a, **k))[1])
import recsys_dist.train.preflight as preflight

count(preflight, "section_problems", "section_problems")
count(preflight, "check_before_launch", "preflight")
import recsys_dist.distributed.plan as planning

count(planning, "plan", "plan")  # the one planning path (the Trainer's plan_job calls it)
spec = get_model("dlrm")
model_build = spec.build


def build_counted(features, cfg):
    note("model_meta" if features.embedding_device.type == "meta" else "model")
    return model_build(features, cfg)


object.__setattr__(spec, "build", build_counted)
note("launcher")
from recsys_dist.cli.main import run

run(sys.argv[2:])
"""


def test_one_validation_one_preflight_one_model_per_rank(tmp_path):
    log = tmp_path / "calls.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RECSYS_DIST_CACHE": str(tmp_path / "cache")}
    argv = ["train", "--config", str(QUICKSTART), "--run-dir", str(tmp_path / "run"), *TINY]
    argv.append("distributed.start_method=fork")
    r = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(log), *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    launcher = next(c["pid"] for c in calls if c["what"] == "launcher")
    per = {}
    for c in calls:
        who = "launcher" if c["pid"] == launcher else f"rank {c['rank']}"
        per.setdefault(who, Counter())[c["what"]] += 1
    print(json.dumps(per, indent=1, sort_keys=True))  # the measured counts, for the record
    assert sorted(per) == ["launcher", "rank 0", "rank 1"], per
    launched = per.pop("launcher")
    # The launcher: the YAML validated once, preflight once (with its one cross-section pass and
    # its one model built on meta), no training model, no plan.
    assert launched["config"] == 1, launched
    assert launched["preflight"] == 1 and launched["section_problems"] == 1, launched
    assert launched["model_meta"] + launched["model"] == 1 and launched["plan"] == 0, launched
    assert launched["feature_spec"] <= 1, launched
    for rank, got in per.items():
        # A rank receives the resolved Job: nothing validated or preflighted again, the model
        # built once (on meta, for the sharder), one planning call.
        assert got["config"] == 0 and got["preflight"] == 0 and got["section_problems"] == 0, (rank, got)
        assert got["model_meta"] + got["model"] == 1, (rank, got)
        assert got["plan"] == 1, (rank, got)
        assert got["feature_spec"] <= 1, (rank, got)
