"""A run directory read back (``metrics.jsonl``, ``summary.json``, ``plan.json``, ``config.yaml``)
and summarised into plain values: the numbers ``recsys-dist report`` / ``compare`` print
(``recsys_dist.cli.report``) and plot (``recsys_dist.cli.run_plots``).

Inputs (written by ``recsys_dist.train.trainer`` and ``recsys_dist.train.stream``):
``metrics.jsonl`` (required), ``summary.json``, ``plan.json`` and ``config.yaml`` (each
optional: a run that died early has only some).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from recsys_dist.errors import RunDirError

EVAL_KEYS = ("auc", "logloss", "ne", "calibration", "accuracy")
# Train-line keys of the step-time breakdown, in pipeline order; other time_*_ms keys follow.
TIME_KEYS = ("time_data_ms", "time_forward_ms", "time_backward_ms", "time_optimizer_ms")


# The splits of metrics.jsonl lines; a line of another split is skipped and counted as unreadable.
# ``partition`` and ``quarantine``: a data.stream run (recsys_dist.train.stream).
SPLIT_NAMES = ("train", "validation", "test", "ledger", "partition", "quarantine")


@dataclass
class Run:
    """One run directory, parsed. ``records`` are metrics.jsonl lines in file order."""

    path: Path
    records: list[dict]
    bad_lines: int = 0
    summary: dict | None = None
    plan: list | None = None
    config: dict | None = None
    missing: list[str] = field(default_factory=list)

    @property
    def stream(self) -> bool:
        """A ``data.stream`` run: summary.json names its partitions, or metrics.jsonl has
        partition, quarantine or per-partition (progressive) validation lines."""
        if "partitions" in (self.summary or {}):
            return True
        return any(r.get("split") in ("partition", "quarantine") or "partition" in r for r in self.records)

    def split(self, name: str) -> list[dict]:
        return [r for r in self.records if r.get("split") == name]

    def final(self, name: str) -> dict:
        """The last record of a split ({} when none)."""
        lines = self.split(name)
        return lines[-1] if lines else {}


def load_run(run_dir: str | Path) -> Run:
    """Parse a run directory.

    Raises:
        RunDirError: the directory or its ``metrics.jsonl`` does not exist, or an
            optional JSON file exists but is not valid JSON.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"run directory {path} does not exist")
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise RunDirError(f"{metrics} is missing (not a run directory, or the run wrote no metrics yet)")
    records, bad = [], 0
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            bad += 1  # e.g. a last line cut short by a crash; the rest is still worth a report
            continue
        # A line whose step is not a number (hand-edited, say) is unreadable like a cut one.
        if isinstance(rec, dict) and isinstance(rec.get("step", 0), int) and rec.get("split", "train") in SPLIT_NAMES:
            records.append(rec)
        else:
            bad += 1
    run = Run(path, records, bad)
    for name, attr, kind in (("summary.json", "summary", dict), ("plan.json", "plan", list)):
        f = path / name
        if not f.is_file():
            run.missing.append(name)
            continue
        try:
            value = json.loads(f.read_text())
        except json.JSONDecodeError as err:
            raise RunDirError(f"{f} is not valid JSON ({err})") from None
        if not isinstance(value, kind):
            raise RunDirError(f"{f} holds a {type(value).__name__}, not the JSON {kind.__name__} recsys-dist writes")
        setattr(run, attr, value)
    if (path / "config.yaml").is_file():
        import yaml

        run.config = yaml.safe_load((path / "config.yaml").read_text())
    return run


def weights_step(run: Run) -> int | None:
    """The step whose weights the test split (and summary.json's validation) scored: the test
    line's ``weights_step``, else summary.json's; None when neither says (an older run, or one
    not finished). After ``train.early_stopping.restore_best`` it is the best validation's step,
    earlier than the last one."""
    for source in (run.final("test"), run.summary or {}):
        if isinstance(source.get("weights_step"), int):
            return source["weights_step"]
    return None


def scored_validation(run: Run) -> dict:
    """The validation metrics of the weights scored (:func:`weights_step`): the last validation
    line at that step, else summary.json's ``validation`` (with ``step`` set); the last
    validation line when the weights step is unknown or no line was written at it ({} when none).

    After early stopping restored the best weights, the last validation line is of the later,
    discarded weights: shown next to the test split's numbers it would compare two models.
    """
    step, last = weights_step(run), run.final("validation")
    if step is None or last.get("step") == step:
        return last
    at = [r for r in run.split("validation") if r.get("step") == step]
    if at:
        return at[-1]
    kept = (run.summary or {}).get("validation")
    return {**kept, "step": step} if isinstance(kept, dict) and kept else last


# ---------------------------------------------------------------- formatting


def time_keys(train: list[dict]) -> list[str]:
    present = {k for r in train for k in r if k.startswith("time_") and k.endswith("_ms")}
    return [k for k in TIME_KEYS if k in present] + sorted(present - set(TIME_KEYS))


def headline(run: Run) -> dict:
    """steps, rows, samples/s, world size: from summary.json, else what metrics.jsonl shows."""
    s = run.summary or {}
    steps = s.get("steps")
    if steps is None and run.records:
        steps = max((r.get("step") or 0) for r in run.records)
    return {
        "steps": steps,
        "rows": s.get("rows_trained"),
        "samples_per_s": s.get("samples_per_s"),
        "world_size": s.get("world_size"),
    }


def plan_bytes_per_rank(plan: list) -> dict[int, int]:
    """rank -> bytes of fp32 embedding weights held there (from plan.json's ``rank_bytes``)."""
    out: dict[int, int] = {}
    for entry in plan:
        for r, b in (entry.get("rank_bytes") or {}).items():
            out[int(r)] = out.get(int(r), 0) + int(b)
    return dict(sorted(out.items()))


def plan_per_rank(plan: list) -> dict[int, Counter]:
    """rank -> Counter(sharding_type -> number of tables with a shard or replica there)."""
    per_rank: dict[int, Counter] = {}
    for entry in plan:
        for r in entry.get("ranks") or []:
            per_rank.setdefault(int(r), Counter())[entry.get("sharding_type", "?")] += 1
    return dict(sorted(per_rank.items()))


def mean(values: list) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float))]
    return sum(vals) / len(vals) if vals else None


def xy(records: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and r.get("step") is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


# ---------------------------------------------------------------- stream runs

# The per-partition counters of managed-collision tables (``managed`` of a partition line).
MANAGED_COUNTERS = ("admitted", "evicted", "evicted_ttl", "collided")
# summary.json's ``stopped``, in words.
STOP_REASONS = {
    "idle": "no new partition for data.stream.stop_after_idle_seconds",
    "max_steps": "train.max_steps reached",
    "SIGTERM": "SIGTERM",
}


def partitions(run: Run) -> list[dict]:
    """A stream run's partitions that were scored or trained, in the order first seen.

    Each dict: ``partition`` (name), ``trained`` (its partition line was written), ``step``
    (the global step after training on it; before, while unfinished), ``rows``, ``steps`` and
    ``seconds`` (of its partition line; absent while unfinished), the progressive-validation
    metrics of its ``validation`` line (:data:`EVAL_KEYS`, ``num_examples``; absent when not
    scored), and ``managed``: each of :data:`MANAGED_COUNTERS` summed over the managed
    features (None without managed-collision tables). A line written again after a resume
    replaces the earlier one.
    """
    out: dict[str, dict] = {}
    for r in run.records:
        name, split = r.get("partition"), r.get("split")
        if not isinstance(name, str) or split not in ("validation", "partition"):
            continue
        row = out.setdefault(name, {"partition": name, "trained": False, "managed": None, "step": r.get("step")})
        if split == "validation":
            row.update({k: r.get(k) for k in (*EVAL_KEYS, "num_examples")})
        else:
            row.update({k: r.get(k) for k in ("step", "rows", "steps", "seconds")}, trained=True)
            row["managed"] = managed_sums(r.get("managed"))
    return list(out.values())


def managed_sums(managed) -> dict | None:
    """``{feature: {admitted, ...}}`` -> ``{admitted: sum over features, ...}`` (None for no dict)."""
    if not isinstance(managed, dict) or not managed:
        return None
    feats = [c for c in managed.values() if isinstance(c, dict)]
    return {k: sum(c[k] for c in feats if isinstance(c.get(k), (int, float))) for k in MANAGED_COUNTERS}


def progressive(parts: list[dict]) -> dict:
    """The partitions' progressive-validation metrics pooled: each of :data:`EVAL_KEYS` as the
    mean over the scored partitions weighted by ``num_examples`` (else ``rows``), plus
    ``partitions`` (how many were scored) and ``rows`` (the weights' sum); {} when none was.

    For unweighted rows the logloss and accuracy so pooled equal those over all the scored
    rows; AUC, NE and calibration are means of per-partition values, not the pooled metric
    (metrics.jsonl holds no predictions to pool).
    """
    scored = [p for p in parts if any(isinstance(p.get(k), (int, float)) for k in EVAL_KEYS)]
    if not scored:
        return {}
    out: dict = {"partitions": len(scored)}
    weights = [p.get("num_examples") if isinstance(p.get("num_examples"), int) else p.get("rows") for p in scored]
    out["rows"] = sum(w for w in weights if isinstance(w, int))
    for k in EVAL_KEYS:
        pairs = [
            (p[k], w) for p, w in zip(scored, weights) if isinstance(p.get(k), (int, float)) and isinstance(w, int)
        ]
        total = sum(w for _, w in pairs)
        out[k] = sum(v * w for v, w in pairs) / total if total else None
    return out


def stream_state(run: Run) -> tuple[list[str], dict[str, str], str | None]:
    """(partitions trained, quarantined name -> error, why it stopped): from summary.json,
    else (a run still going, or killed) from metrics.jsonl with the reason None."""
    s = run.summary or {}
    if isinstance(s.get("partitions"), list):
        trained = [str(n) for n in s["partitions"]]
    else:
        trained = [p["partition"] for p in partitions(run) if p["trained"]]
    if isinstance(s.get("quarantined"), dict):
        quarantined = {str(k): str(v) for k, v in s["quarantined"].items()}
    else:
        quarantined = {r.get("partition", "?"): str(r.get("error", "")) for r in run.split("quarantine")}
    return trained, quarantined, s.get("stopped")
