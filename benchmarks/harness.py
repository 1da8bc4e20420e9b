"""The benchmark harness: what every bench in ``benchmarks/`` shares.

A bench is a script ``benchmarks/NAME.py``, run from the repository root as
``PYTHONPATH=$PWD .venv/bin/python benchmarks/NAME.py [--smoke] [--record [ITEM]] ...``. It imports
this module as ``harness`` (Python puts a script's folder on ``sys.path``); tests import it as
``benchmarks.harness``. The helper modules ``baselines``, ``growth``, ``hardware`` and ``netns``
import neither this module nor each other, so tests can import them as ``benchmarks.X`` too
(``ours`` and ``servers`` import it: benches only). Five parts:

1. **The environment record** (:func:`environment`): machine (CPU model, cores, memory, GPUs,
   load), Python / torch / torchrec / fbgemm versions, the git commit, UTC time; and the hardware
   tag of results files (:func:`hardware_tag`: ``cpu2core``, ``h200``, ``h200x8``).
2. **Interleaved rounds** (:func:`abba`, :class:`Bench`, :func:`run_bench`): every contender once
   a round, in ABBA order (A B, B A, A B, ...), so load from other processes, which drifts
   slowly, weighs on every contender alike.
3. **Statistics** (:func:`median`, :func:`paired_ratio`, :func:`bootstrap_interval`,
   :func:`paired_bootstrap`, :func:`fit_exponent`, :func:`steady_rate`).
4. **Runs in fresh processes** (:func:`cli`, :func:`start_cli`, :func:`train`, :func:`python`,
   :func:`converted_test_split`, :func:`criteo_sample`, :func:`free_port`).
5. **The command line and the results writer** (:func:`parser`, :class:`Results`): every bench
   takes ``--smoke`` (tiny sizes: it starts and runs, in seconds to a minute; the numbers mean
   nothing) and ``--record [ITEM]``, which writes its output to
   ``benchmarks/results/<ITEM>_<hw>_<YYYYMMDD>.md`` (UTC date) under the exact command line and
   the environment record. A results file is never overwritten: an existing one is refused
   before the bench starts.

Only the standard library is imported at module level (numpy inside the bootstrap), so a bench's
``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
CONFIGS = ROOT / "configs"
SAMPLE = ROOT / "datasets" / "criteo_kaggle" / "dac_train_first10000.txt"  # 10,000 real Criteo rows
# Overrides that make any training run of a bench tiny under --smoke.
SMOKE_TRAIN = ["train.max_steps=4", "train.epochs=1"]
SOFTWARE = ("torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "numpy", "pyarrow")

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# 1. The environment record


def environment() -> dict:
    """What a result depends on besides the code's inputs, read without importing torch:
    ``utc`` (start, ``YYYY-MM-DD HH:MM:SS``), ``machine`` (``cpu``, ``arch``, ``cores``,
    ``usable_cores``, ``memory_gib``, ``gpus``: names, ``load``: 1-minute load average),
    ``software`` (``python`` and each installed distribution of :data:`SOFTWARE`: version) and
    ``commit`` (short hash, ``+ uncommitted changes`` when tracked files differ; ``not recorded``
    outside a git checkout)."""
    return {
        "utc": _utc_now(),
        "machine": {
            "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "not recorded",
            "arch": platform.machine(),
            "cores": os.cpu_count() or 1,
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "memory_gib": round(int(mem.split()[0]) / 2**20, 1)
            if (mem := _proc_field("/proc/meminfo", "MemTotal"))
            else None,
            "gpus": _gpus(),
            "load": round(os.getloadavg()[0], 2),
        },
        "software": {"python": platform.python_version(), **_versions()},
        "commit": _commit(),
    }


def hardware_tag(env: dict) -> str:
    """The ``<hw>`` of a results file name: the GPU model, lower case without vendor and
    punctuation (``NVIDIA H200`` -> ``h200``; ``h200x8`` for eight), else ``cpu<cores>core``."""
    gpus = env["machine"]["gpus"]
    if gpus:
        words = [w for w in gpus[0].lower().replace("-", " ").split() if w not in ("nvidia", "tesla", "geforce")]
        name = "".join(c for c in "".join(words[:1] or ["gpu"]) if c.isalnum())
        return name + (f"x{len(gpus)}" if len(gpus) > 1 else "")
    return f"cpu{env['machine']['cores']}core"


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _proc_field(path: str, prefix: str) -> str | None:
    """The value after ``prefix...:`` on the first such line of ``path`` (None: no such file or line)."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(prefix)), None)
    except OSError:
        return None


def _gpus() -> list[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def _versions() -> dict[str, str]:
    out = {}
    for name in SOFTWARE:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return out


def _commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=20).stdout

    try:
        head = git("rev-parse", "--short=12", "HEAD").strip()
        dirty = git("status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.TimeoutExpired):
        return "not recorded"
    return (head + (" + uncommitted changes" if dirty else "")) if head else "not recorded"


def describe(env: dict, end: dict | None = None) -> list[str]:
    """Markdown bullet lines of an :func:`environment` record (``end``: one taken at the end,
    for the finish time and load)."""
    m, s = env["machine"], env["software"]
    gpus = ", ".join(m["gpus"]) if m["gpus"] else "no GPU"
    load = f"1-minute load average {m['load']} at the start" + (f", {end['machine']['load']} at the end" if end else "")
    cores = f"{m['cores']} cores" + (f" ({m['usable_cores']} usable)" if m["usable_cores"] != m["cores"] else "")
    mem = f"{m['memory_gib']} GiB memory" if m["memory_gib"] else "memory not recorded"
    when = env["utc"] + (f" -> {end['utc']}" if end else "")
    return [
        f"- **Machine:** {m['cpu']} ({m['arch']}), {cores}, {mem}, {gpus}; {load}",
        "- **Software:** " + ", ".join(f"{k} {v}" for k, v in s.items()),
        f"- **Commit:** {env['commit']}",
        f"- **Time (UTC):** {when}",
    ]


# ---------------------------------------------------------------------------------------------
# 2. Interleaved rounds


def abba_order(names: Sequence[T], round_index: int) -> list[T]:
    """Round ``round_index``'s order: ``names`` as given in even rounds, reversed in odd ones."""
    return list(names) if round_index % 2 == 0 else list(names)[::-1]


def abba(
    contenders: Mapping[str, Callable[[], T]],
    rounds: int,
    on_result: Callable[[int, str, T], None] | None = None,
) -> dict[str, list[T]]:
    """Call every contender once per round, ``rounds`` rounds in ABBA order; each contender's
    results in round order. ``on_result(round, name, result)`` after each call (e.g. to print).

    Raises:
        ValueError: ``rounds`` < 1 or no contenders.
    """
    if rounds < 1 or not contenders:
        raise ValueError(f"abba: need at least one round and one contender, got {rounds} and {list(contenders)}")
    out: dict[str, list[T]] = {name: [] for name in contenders}
    for r in range(rounds):
        for name in abba_order(list(contenders), r):
            out[name].append(contenders[name]())
            if on_result is not None:
                on_result(r, name, out[name][-1])
    return out


class Bench(Protocol):
    """A bench as :func:`run_bench` runs it: the names of its contenders, and one round of one."""

    def contenders(self) -> Sequence[str]: ...

    def run_round(self, contender: str) -> Any: ...


def run_bench(bench: Bench, rounds: int, on_result: Callable[[int, str, Any], None] | None = None) -> dict:
    """:func:`abba` over ``bench``'s contenders: ``{contender: [run_round's result per round]}``."""
    return abba({c: functools.partial(bench.run_round, c) for c in bench.contenders()}, rounds, on_result)


# ---------------------------------------------------------------------------------------------
# 3. Statistics


def median(values: Sequence[float]) -> float:
    """The median (the mean of the middle two of an even count)."""
    return statistics.median(values)


def paired_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]`` per round (a ratio within a round: both sides saw the same load).

    Raises:
        ValueError: the two have different lengths.
    """
    if len(a) != len(b):
        raise ValueError(f"paired ratios: {len(a)} rounds of one contender vs {len(b)} of the other")
    return [x / y for x, y in zip(a, b)]


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of ``a / b`` within the round."""
    return median(paired_ratios(a, b))


def ratio_interval(a: Sequence[float], b: Sequence[float]) -> str:
    """``[lo, hi]``: the 95% bootstrap interval of :func:`paired_ratio` (resampling the rounds)."""
    lo, hi = bootstrap_interval(paired_ratios(a, b))
    return f"[{lo:.3f}, {hi:.3f}]"


def bootstrap_interval(
    values: Sequence[float],
    stat: Callable[[Sequence[float]], float] = median,
    n: int = 2000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """The percentile bootstrap interval of ``stat(values)``: ``n`` resamples with replacement,
    the (1 - level) / 2 and (1 + level) / 2 quantiles of their statistic. One value gives
    (value, value)."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    stats = [stat(list(x[rng.integers(0, len(x), len(x))])) for _ in range(n)]
    lo, hi = np.quantile(stats, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def paired_bootstrap(
    labels: Sequence,
    a: Sequence,
    b: Sequence,
    metric: Callable[[Any, Any], float],
    n: int = 1000,
    seed: int = 0,
) -> tuple[float, list[float]]:
    """The mean over seeds of metric(a) - metric(b) on the test rows, and its 95% interval.

    ``a[s]`` and ``b[s]`` are the two variants' scores of seed s for the same rows, in the
    order of ``labels``. Each of ``n`` bootstrap replicates draws one resample of the rows
    (with replacement) and scores every seed of both variants on it; replicates with a single
    label value are skipped (AUC is undefined there). Returns (point difference, [2.5th,
    97.5th percentile of the replicates]).

    Raises:
        ValueError: ``a`` and ``b`` hold different numbers of runs.
    """
    import numpy as np

    labels = np.asarray(labels)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} runs of one variant vs {len(b)} of the other")
    point = float(np.mean([metric(labels, x) - metric(labels, y) for x, y in zip(a, b)]))
    rng = np.random.default_rng(seed)
    rows = len(labels)
    diffs = []
    for _ in range(n):
        i = rng.integers(0, rows, rows)
        if labels[i].min() == labels[i].max():
            continue
        diffs.append(float(np.mean([metric(labels[i], x[i]) - metric(labels[i], y[i]) for x, y in zip(a, b)])))
    return point, [float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5))]


def seconds(fn: Callable[[], Any], n: int) -> list[float]:
    """Wall seconds of each of ``n`` calls of ``fn()``."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y on log x: y ~ x^k (y clipped at 1e-9; nan for one x)."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / den if den else float("nan")


def steady_rate(lines: list[dict], global_batch: int) -> float:
    """Samples/s of a run's training after its first logged window (metrics.jsonl ``train``
    lines with ``samples_per_s``): that window holds one-time costs (the pipeline's fill, fx trace
    and rewrite of the model). Rows / seconds summed over the later windows, rounded to 0.1.

    Raises:
        SystemExit: fewer than two train lines.
    """
    train = [r for r in lines if r.get("split") == "train" and r.get("samples_per_s")]
    rows = secs = 0.0
    for prev, cur in zip(train, train[1:]):
        n = (cur["step"] - prev["step"]) * global_batch
        rows, secs = rows + n, secs + n / cur["samples_per_s"]
    if not secs:
        raise SystemExit("steady rate: fewer than two train log lines; raise the number of steps")
    return round(rows / secs, 1)


# ---------------------------------------------------------------------------------------------
# 4. Runs in fresh processes


def child_env(code: Path = ROOT, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` = the checkout ``code`` and its
    ``benchmarks/`` (so a child imports that ``recsys_dist`` and ``harness``)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(code), str(code / "benchmarks")]), **(extra or {})}


def python(code: str, *argv: str, executable: str = sys.executable, env: Mapping[str, str] | None = None) -> str:
    """``executable -c code argv...`` in a fresh process (:func:`child_env`); its stdout.

    Raises:
        RuntimeError: a non-zero exit, with the end of its stderr.
    """
    r = subprocess.run([executable, "-c", code, *argv], capture_output=True, text=True, env=env or child_env())
    if r.returncode:
        raise RuntimeError(f"{executable} -c ... -> exit {r.returncode}\n{r.stderr[-3000:]}")
    return r.stdout


def last_json(stdout: str) -> Any:
    """The JSON value on the last line of ``stdout``."""
    return json.loads(stdout.strip().splitlines()[-1])


def cli(*args: Any, code: Path = ROOT, retries: int = 0, env: Mapping[str, str] | None = None) -> tuple[str, float]:
    """``recsys-dist ARGS`` in a fresh process, importing and running from the checkout ``code``
    (default this one; ``env``: variables to set over :func:`child_env`'s). Returns (stdout, wall
    seconds of the last try); ``retries`` more tries after a failure.

    Raises:
        RuntimeError: a non-zero exit (of the last try), with the end of its stderr.
    """
    cmd = [sys.executable, "-m", "recsys_dist.cli.main", *map(str, args)]
    for attempt in range(retries + 1):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, cwd=code, capture_output=True, text=True, env=child_env(code, env))
        if r.returncode == 0:
            return r.stdout, time.perf_counter() - t0
        if attempt < retries:
            print(f"  (run failed once, retrying: {r.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
    raise RuntimeError(f"recsys-dist {' '.join(map(str, args))} -> exit {r.returncode}\n{r.stderr[-3000:]}")


def start_cli(*args: Any, log: Path | None = None, code: Path = ROOT) -> subprocess.Popen:
    """``recsys-dist ARGS`` started in the background (as :func:`cli`), its stdout and stderr
    into the file ``log`` (None: this process's)."""
    out = open(log, "w") if log is not None else None  # noqa: SIM115 - the child holds it
    cmd = [sys.executable, "-m", "recsys_dist.cli.main", *map(str, args)]
    return subprocess.Popen(cmd, cwd=code, env=child_env(code), stdout=out, stderr=subprocess.STDOUT if out else None)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train(config: Path | str, run_dir: Path | str, *overrides: str, code: Path = ROOT, retries: int = 0) -> dict:
    """``recsys-dist train --config CONFIG --run-dir RUN_DIR OVERRIDES`` (progress bar off); the
    run's summary.json with ``wall_s``: the command's wall seconds. Raises as :func:`cli`."""
    _, wall = cli(
        "train",
        "--config",
        config,
        "--run-dir",
        run_dir,
        "train.progress_bar=false",
        *overrides,
        code=code,
        retries=retries,
    )
    return {**summary(run_dir), "wall_s": wall}


def summary(run_dir: Path | str) -> dict:
    """A run directory's summary.json."""
    return json.loads((Path(run_dir) / "summary.json").read_text())


def metrics(run_dir: Path | str) -> list[dict]:
    """A run directory's metrics.jsonl lines."""
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def mean_metric(run_dir: Path | str, key: str) -> float | None:
    """The mean of ``key`` over the run's metrics.jsonl lines that have it, rounded to 0.01
    (None: no line has it)."""
    values = [m[key] for m in metrics(run_dir) if key in m]
    return round(sum(values) / len(values), 2) if values else None


def converted_test_split(config: Path | str, *overrides: str) -> Path:
    """The converted test split of CONFIG (with OVERRIDES), as ``recsys-dist preprocess``
    names it: the conversion cache entry its manifest sits in."""
    out, _ = cli("preprocess", "--config", config, "--quiet", *overrides)
    manifest = next(line.split("manifest:")[1].strip() for line in out.splitlines() if "manifest:" in line)
    return Path(manifest).parent / "test.parquet"


def criteo_sample(path: Path, copies: int = 1, rows: int | None = None) -> Path:
    """Write the shipped Criteo sample (:data:`SAMPLE`; its first ``rows`` rows) ``copies`` times
    to ``path``; returns ``path``."""
    block = SAMPLE.read_bytes()
    if rows is not None:
        block = b"".join(block.splitlines(keepends=True)[:rows])
    with open(path, "wb") as f:
        for _ in range(copies):
            f.write(block)
    return path


def load_file(path: Path, name: str):
    """The Python file ``path`` as a module named ``name`` (for files outside any package, e.g.
    ``pipelines/criteo_hourly.py``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------
# 5. The command line and the results writer


def parser(doc: str, item: str, smoke: str) -> argparse.ArgumentParser:
    """The bench's argument parser, its description ``doc`` (the module docstring), with the
    harness's options: ``--smoke`` (``smoke`` says what it shrinks to), ``--record [ITEM]``
    (default ITEM ``item``) and ``--results-dir``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("harness (benchmarks/harness.py)")
    g.add_argument("--smoke", action="store_true", help=f"tiny sizes, to check that the bench runs: {smoke}")
    g.add_argument(
        "--record",
        nargs="?",
        const=item,
        default=None,
        metavar="ITEM",
        help=f"also write the output, under the command, machine, versions, commit and UTC time, to "
        f"RESULTS_DIR/ITEM_<hw>_<YYYYMMDD>.md (ITEM default: {item}; hw e.g. cpu2core); an existing file "
        "is refused before the run",
    )
    g.add_argument(
        "--results-dir", type=Path, default=RESULTS, help="where --record writes (default: benchmarks/results)"
    )
    return p


def results_path(item: str, env: dict, directory: Path = RESULTS) -> Path:
    """``directory/<item>_<hw>_<YYYYMMDD>.md``: :func:`hardware_tag`, the UTC date of ``env``."""
    return Path(directory) / f"{item}_{hardware_tag(env)}_{env['utc'][:10].replace('-', '')}.md"


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that ran this process, as typed from the repository root: ``PYTHONPATH``
    when set (``$PWD`` for the root), the interpreter and script relative to the root, ``argv``
    (default ``sys.argv[1:]``); ``cd DIR &&`` first when run from elsewhere."""

    def rel(p: str) -> str:
        path = Path(p).absolute()
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else p

    args = list(sys.argv[1:] if argv is None else argv)
    words = [rel(sys.executable), rel(sys.argv[0]), *args]
    cmd = shlex.join(words)
    pythonpath = os.environ.get("PYTHONPATH")
    if pythonpath:
        parts = ["$PWD" if Path(p).absolute() == ROOT else shlex.quote(p) for p in pythonpath.split(os.pathsep)]
        cmd = f"PYTHONPATH={os.pathsep.join(parts)} {cmd}"
    return cmd if Path.cwd() == ROOT else f"cd {shlex.quote(str(Path.cwd()))} && {cmd}"


class _Tee(io.TextIOBase):
    """stdout that also keeps what was written."""

    def __init__(self, stream) -> None:
        self.stream, self.parts = stream, []

    def write(self, s: str) -> int:
        self.parts.append(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


class Results:
    """A bench run's environment (taken when made) and, with ``--record`` or ``path``, its
    results file. Used as a context manager around the run: what the bench prints goes to
    stdout as always and, when recording, into the file on a clean exit::

        args = harness.parser(__doc__, "coverage_overhead", "...").parse_args(argv)
        with harness.Results(args, argv):
            ...  # print the results

    ``path``: write there instead of the named file (a bench's own ``--out FILE``); ``title``: the
    file's heading (default the first line of the script's docstring). A bench that composes a
    markdown report sets :attr:`markdown` to it: the file then holds that report instead of the
    printed output (:func:`render`).

    Raises:
        SystemExit: the results file exists (a new run gets a new file: pass another ITEM), or
            ``--smoke`` output would go to benchmarks/results/.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        argv: Sequence[str] | None = None,
        *,
        path: Path | None = None,
        title: str | None = None,
    ) -> None:
        self.env, self.command, self.title = environment(), command_line(argv), title
        self.markdown: str | None = None
        self.path = Path(path) if path is not None else None
        if self.path is None and args.record:
            self.path = results_path(args.record, self.env, args.results_dir)
        if self.path is not None:
            if args.smoke and self.path.resolve().parent == RESULTS:
                raise SystemExit("--smoke: its numbers mean nothing; not recorded under benchmarks/results/")
            if self.path.exists():
                raise SystemExit(
                    f"{self.path} exists: a results file is never overwritten; pass --record ANOTHER_ITEM "
                    "(e.g. the question this run answers) for a new file"
                )
        self._tee: _Tee | None = None
        self._redirect = None

    def __enter__(self) -> Results:
        self._tee = _Tee(sys.stdout)
        self._redirect = contextlib.redirect_stdout(self._tee)
        self._redirect.__enter__()
        return self

    def __exit__(self, kind, value, tb) -> None:
        self._redirect.__exit__(kind, value, tb)
        if kind is None and self.path is not None:
            self.write(self.markdown if self.markdown is not None else render("".join(self._tee.parts)))
            print(f"recorded: {self.path}")

    def write(self, body: str) -> Path:
        """Write the results file: heading, command, environment (start and end), ``body``
        (markdown)."""
        title = self.title or _doc_title()
        body = body.rstrip("\n")
        lines = [f"# {title}", "", f"- **Command:** `{self.command}`", *describe(self.env, environment())]
        lines += ["", "What the bench measures and how to read it: docs/benchmarks.md.", "", body, ""]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(lines))
        return self.path


def render(output: str) -> str:
    """Printed output as markdown: runs of lines that start with ``|`` (a markdown table the
    bench printed) as they are, everything else verbatim in ``text`` blocks."""
    blocks: list[tuple[bool, list[str]]] = []
    for line in output.rstrip().splitlines():
        table = line.startswith("|")
        if not blocks or blocks[-1][0] != table:
            blocks.append((table, []))
        blocks[-1][1].append(line)
    parts = []
    for table, b in blocks:
        text = "\n".join(b).strip("\n")
        if text.strip():
            parts.append(text if table else f"```text\n{text}\n```")
    return "\n\n".join(parts)


def _doc_title() -> str:
    main = sys.modules.get("__main__")
    doc = (getattr(main, "__doc__", None) or "").strip()
    name = Path(sys.argv[0]).name
    return f"`benchmarks/{name}`: " + (doc.splitlines()[0] if doc else "results")
