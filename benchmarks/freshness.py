"""Freshness: from a partition landing to the server's scores reflecting it.

Runs, side by side, ``recsys-dist train`` on a stream config (``configs/criteo_online.yaml``
with ``data.stream.stop_after_idle_seconds: null`` and ``publish: {enabled: true,
every_partition: true}``) and ``recsys-dist serve PUBLISH_DIR --reload-seconds 0.5``. Partition
0 is landed first (its publish is the full version the server starts from); then, one at a
time, partitions 1..N are landed with ``pipelines/criteo_hourly.py``'s ``land()`` and each is
timed through its stages:

- ``landed``: the atomic rename (``land()`` returns);
- ``trained``: its ``partition`` line appears in ``metrics.jsonl`` (that line's ``seconds``
  is the partition's own scoring + training; the rest of landed -> trained is the pick-up:
  ``poll_seconds``, conversion, opening the loaders);
- ``published``: the publish directory's ``manifest.json`` ``latest`` changes (the checkpoint
  at the partition's end and the publish);
- ``served``: ``GET /health`` answers the new ``version`` (the server's reload poll and load);
- ``scored``: a ``POST /score`` of fixed rows (the first 64 rows after the landed ones)
  answers that version, with scores that differ from the previous version's.

The next partition lands only once the previous one was scored (each measured alone, no
queueing). The harness polls files every ``--poll-ms`` ms and ``/health`` every 2x that: a
stage's time is late by up to that much. At the end: SIGTERM to both (train checkpoints and
exits 0). Then p50 / p95 per stage and end to end.

Not a test. Usage:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/freshness.py [--partitions 8] [--poll-seconds 1]
        [--reload-seconds 0.5] [--record ITEM | --out FILE.md]

It always writes its results file: benchmarks/results/freshness_<hw>_<YYYYMMDD>.md unless
``--record ITEM`` or ``--out FILE`` says otherwise (``--smoke``: only with ``--out``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import harness

if TYPE_CHECKING:
    import httpx

ONLINE = harness.CONFIGS / "criteo_online.yaml"
STAGES = ("trained", "published", "served", "scored")
TIMEOUT_S = 180.0


def hourly():
    """``pipelines/criteo_hourly.py`` as a module (``land``, ``partition_name``)."""
    return harness.load_file(harness.ROOT / "pipelines" / "criteo_hourly.py", "criteo_hourly")


def write_config(work: Path, poll_seconds: float) -> Path:
    import yaml

    cfg = yaml.safe_load(ONLINE.read_text())
    # min_file_age_seconds 0: the producer (criteo_hourly.land) renames each finished file into place.
    stream = dict(path=str(work / "landing"), poll_seconds=poll_seconds, stop_after_idle_seconds=None)
    cfg["data"]["stream"].update(**stream, min_file_age_seconds=0)
    cfg["publish"] = {"enabled": True, "every_partition": True, "dir": str(work / "publish")}
    path = work / "freshness.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


class Watch:
    """The run's ``metrics.jsonl`` ``partition`` lines and the publish manifest's ``latest``."""

    def __init__(self, run_dir: Path, publish_dir: Path) -> None:
        self.metrics, self.manifest = run_dir / "metrics.jsonl", publish_dir / "manifest.json"

    def partition_line(self, name: str) -> dict | None:
        try:
            text = self.metrics.read_text()
        except FileNotFoundError:
            return None
        for line in text.splitlines():
            if f'"{name}"' in line and '"split": "partition"' in line:
                return json.loads(line)
        return None

    def step_of(self, version: int) -> int | None:
        """The training step the manifest records for ``version``."""
        try:
            entries = json.loads(self.manifest.read_text())["versions"]
        except (FileNotFoundError, ValueError, KeyError):
            return None
        return next((e.get("step") for e in entries if e.get("version") == version), None)

    def latest(self) -> int | None:
        try:
            return json.loads(self.manifest.read_text()).get("latest")
        except (FileNotFoundError, ValueError):
            return None


def wait_for(what: str, fn, poll_s: float, deadline: float, procs: list):
    """Call ``fn`` every ``poll_s`` until it returns something truthy; (value, perf_counter)."""
    while True:
        value = fn()
        if value:
            return value, time.perf_counter()
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"waiting for {what}: recsys-dist {p.args[3]} exited with {p.returncode}")
        if time.perf_counter() > deadline:
            raise SystemExit(f"waiting for {what}: no answer in {TIMEOUT_S}s")
        time.sleep(poll_s)


def score(client: httpx.Client, url: str, rows: list[str]):
    """(version, scores as a float array) of a ``POST /score`` of ``rows``."""
    import numpy as np

    r = client.post(f"{url}/score", json={"rows": rows})
    r.raise_for_status()
    body = r.json()
    return body["version"], np.array(body["scores"])


def health_version(client: httpx.Client, url: str) -> int | None:
    import httpx

    try:
        return client.get(f"{url}/health").json()["version"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None


def measure(i, h, work, watch, client, url, rows, state, args, procs) -> dict:
    """Land partition ``i`` and time it through the stages (module doc)."""
    poll = args.poll_ms / 1000
    deadline = time.perf_counter() + TIMEOUT_S
    name = h.partition_name(i)
    t_land0 = time.perf_counter()
    h.land(work / "landing", name, state["parts"][i])
    t = {"landed": time.perf_counter()}
    line, t["trained"] = wait_for(f"{name} trained", lambda: watch.partition_line(name), poll, deadline, procs)
    old = state["version"]
    version, t["published"] = wait_for(
        f"{name} published", lambda: (v := watch.latest()) is not None and v != old and v, poll, deadline, procs
    )
    state["version"] = version
    _, t["served"] = wait_for(
        f"version {version} served", lambda: (health_version(client, url) or 0) >= version, 2 * poll, deadline, procs
    )
    v, scores = score(client, url, rows)
    t["scored"] = time.perf_counter()
    changed = float(abs(scores - state["scores"]).max())
    state["scores"] = scores
    stages = {s: t[s] - t[p] for p, s in zip(("landed", *STAGES), STAGES, strict=False)}
    return {
        "partition": name,
        "version": version,
        "served_version": v,
        "step": line["step"],
        "published_step": watch.step_of(version),
        "partition_seconds": line["seconds"],
        "land_s": t["landed"] - t_land0,
        **stages,
        "total": t["scored"] - t["landed"],
        "max_score_change": changed,
        "load": round(os.getloadavg()[0], 2),
    }


def start(args, work: Path, config: Path):
    """Land partition 0, start train, wait for its first model, start serve; (procs, url, serve dir)."""
    train = harness.start_cli("train", "--config", config, "--run-dir", work / "run", log=work / "train.log")
    watch = Watch(work / "run", work / "publish")
    deadline = time.perf_counter() + TIMEOUT_S
    name = hourly().partition_name(0)
    wait_for(f"{name} trained", lambda: watch.partition_line(name), 0.1, deadline, [train])
    wait_for("the first publish", watch.latest, 0.1, deadline, [train])
    serve_dir = work / "publish"
    port = harness.free_port()
    serve = harness.start_cli(
        "serve", serve_dir, "--port", port, "--reload-seconds", args.reload_seconds, log=work / "serve.log"
    )
    return [train, serve], f"http://127.0.0.1:{port}", watch


def stop(procs: list) -> list[int | None]:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=120))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(None)
    return codes


def run(args, work: Path) -> tuple[list[dict], list]:
    """Land partition 0, start both, measure partitions 1..N, stop both; (rows, exit codes,
    the train run's summary)."""
    import httpx

    h = hourly()
    lines = harness.SAMPLE.read_bytes().splitlines(keepends=True)
    n, r = args.partitions, args.rows
    parts = [lines[k * r : (k + 1) * r] for k in range(n + 1)]
    rows = [x.decode().rstrip("\n") for x in lines[(n + 1) * r : (n + 1) * r + 64]]  # never trained on
    config = write_config(work, args.poll_seconds)
    h.land(work / "landing", h.partition_name(0), parts[0])
    procs, url, watch = start(args, work, config)
    results = []
    try:
        with httpx.Client(timeout=60) as client:
            deadline = time.perf_counter() + TIMEOUT_S
            version, _ = wait_for("the server", lambda: health_version(client, url), 0.1, deadline, procs)
            _, scores = score(client, url, rows)
            state = {"parts": parts, "version": version, "scores": scores}
            for i in range(1, n + 1):
                time.sleep(args.gap)
                res = measure(i, h, work, watch, client, url, rows, state, args, procs)
                print(json.dumps(res), flush=True)
                results.append(res)
    finally:
        codes = stop(procs)
    try:
        summary = json.loads((work / "run" / "summary.json").read_text())
    except (FileNotFoundError, ValueError):
        summary = {}
    return results, codes, summary


def report(results: list[dict], codes: list, summary: dict, args) -> str:
    """The markdown report: setup, a row per partition, p50 / p95 and shares per stage."""
    import numpy as np

    cols = ("pickup", *STAGES, "total")
    for r in results:
        r["pickup"] = r["trained"] - r["partition_seconds"]
    out = [
        f"- **Setup:** `configs/criteo_online.yaml` (DLRM, 2 ranks, partitions of {args.rows:,} rows of the shipped "
        f"Criteo sample), `data.stream.poll_seconds: {args.poll_seconds}`, `stop_after_idle_seconds: null`, "
        + "`publish: {enabled: true, every_partition: true}` (safetensors, no quantization); "
        + f"`recsys-dist serve --reload-seconds {args.reload_seconds}`. Partition 0 landed first (the served full "
        f"version); partitions 1-{args.partitions} then one at a time, each after the previous one was scored "
        f"(+{args.gap} s). The bench polls every {args.poll_ms} ms (files) / {2 * args.poll_ms} ms (/health). "
        f"Exit codes after SIGTERM: train {codes[0]}, serve {codes[1]}. Train (2 ranks), server and bench on the "
        "same cores, shared with other jobs (1-minute load per partition below).",
        "",
        "Stages (seconds): `pickup` = landed -> trained minus the partition line's `seconds` (poll wait, "
        "conversion, loader opening); `trained` = landed -> `partition` line (pickup + scoring + training); "
        "`published` = -> manifest `latest` changes; `served` = -> `/health` version changes; `scored` = -> "
        "`POST /score` of 64 fixed rows answered by that version.",
        "",
        "| partition | version | step (trained, published) | "
        + " | ".join(cols)
        + " | partition line s | max score change | load |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in cols) + " | ---: | ---: | ---: |",
    ]
    for r in results:
        out.append(
            f"| {r['partition']} | {r['version']} | {r['step']}, {r['published_step']} | "
            + " | ".join(f"{r[c]:.3f}" for c in cols)
            + f" | {r['partition_seconds']:.3f} | {r['max_score_change']:.2e} | {r['load']} |"
        )
    out += ["", "| | " + " | ".join(cols) + " |", "| --- | " + " | ".join("---:" for _ in cols) + " |"]
    for q in (50, 95):
        out.append(f"| p{q} | " + " | ".join(f"{np.percentile([r[c] for r in results], q):.3f}" for c in cols) + " |")
    out.append("| mean share of total | " + " | ".join(_share(results, c) for c in cols) + " |")
    split, n = summary.get("wall_split") or {}, args.partitions + 1
    if split:
        out += [
            "",
            f"The train run's `summary.json` `wall_split` (rank 0, whole run: {n} partitions, partition 0 included, "
            "and the idle waits in `other`): "
            + ", ".join(f"{k} {v:.2f} s" for k, v in split.items())
            + f"; per partition: checkpoint {split.get('checkpoint', 0) / n:.3f} s, publish "
            f"{split.get('publish', 0) / n:.3f} s, eval {split.get('eval', 0) / n:.3f} s, train "
            f"{split.get('train', 0) / n:.3f} s.",
        ]
    return "\n".join(out) + "\n"


def _share(results: list[dict], col: str) -> str:
    import numpy as np

    return f"{100 * np.mean([r[col] for r in results]) / np.mean([r['total'] for r in results]):.0f} %"


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__, "freshness", "1 partition of 200 rows, 0.2 s polls")
    parser.add_argument("--partitions", type=int, default=8, help="partitions measured (after partition 0)")
    parser.add_argument("--rows", type=int, default=1000, help="rows per partition")
    parser.add_argument("--poll-seconds", type=float, default=1.0, help="data.stream.poll_seconds")
    parser.add_argument("--reload-seconds", type=float, default=0.5, help="serve --reload-seconds")
    parser.add_argument("--poll-ms", type=float, default=20.0, help="the bench's poll of files")
    parser.add_argument("--gap", type=float, default=1.0, help="seconds between a score and the next landing")
    parser.add_argument("--keep", default=None, help="work directory to keep (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="the results file (default: the one --record names)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.partitions, args.rows, args.poll_seconds, args.reload_seconds, args.gap = 1, 200, 0.2, 0.2, 0.1
    elif args.record is None and args.out is None:
        args.record = "freshness"  # always recorded
    title = "`benchmarks/freshness.py`: landing -> trained -> published -> served"
    with harness.Results(args, argv, path=args.out, title=title) as res:
        with tempfile.TemporaryDirectory(prefix="freshness_") as tmp:
            work = Path(args.keep or tmp)
            work.mkdir(parents=True, exist_ok=True)
            results, codes, summary = run(args, work)
            res.markdown = report(results, codes, summary, args)
        print(res.markdown)


if __name__ == "__main__":
    main()
