"""Load benchmark of ``recsys-dist serve``: latency (p50 / p99) and rows/s at batch 1, 64 and 512.

Through the real HTTP server (``recsys-dist serve`` in a subprocess, uvicorn) with keep-alive
clients: 1 to 64 connections at once (an asyncio client in this process, one request in flight
per connection, ``--connections``), and a fresh connection per request for comparison; side by
side with in-process calls on the same rows:

- ``in-memory``: the server's scoring of a request (``recsys_dist.serve.inmemory``: the rows'
  raw columns converted in memory by the conversion's own transforms, then the model), without
  HTTP, rows as text lines and as JSON objects;
- ``score_rows``: the file route (JSON rows -> raw file -> predict's conversion -> model), which
  the server used before the in-memory route and still uses for a model that route does not cover;
- ``forward``: the loaded model's forward alone, on the batch already converted;
- ``torchscript``: the export's ``model.torchscript.pt`` on the same converted batch (when the
  export has one: ``recsys-dist export --format torchscript``).

``--compare-nagle`` runs, instead, two servers of the same export side by side, one as served
before TCP_NODELAY was set (its listening socket made without ``IPPROTO_TCP``, the protocol's
``no_delay`` off: Nagle's algorithm on) and one as served now, in interleaved rounds, keep-alive
HTTP only.

Not a test. Usage:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/serve_load.py EXPORT_DIR [--requests 200] [--out FILE.md]
    PYTHONPATH=$PWD .venv/bin/python benchmarks/serve_load.py EXPORT_DIR --compare-nagle --rounds 2
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import harness
import servers

BATCHES = (1, 64, 512)


def _stats(latencies: list[float], rows: int, wall: float) -> dict:
    import numpy as np

    ms = np.array(latencies) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "rows_s": rows / wall}


def _batches(lines: list[str], n: int, count: int) -> list[list[str]]:
    """``count`` batches of ``n`` consecutive lines (wrapping around the sample)."""
    return [[lines[(i * n + j) % len(lines)] for j in range(n)] for i in range(count)]


async def _keep_alive_client(port: int, bodies: list[bytes], latencies: list[float]) -> None:
    """One keep-alive connection POSTing ``bodies`` one after another (HTTP/1.1 by hand: the
    request in one write, the answer read by its content-length)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)  # asyncio sets TCP_NODELAY here
    try:
        for body in bodies:
            t = time.perf_counter()
            writer.write(
                b"POST /score HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            answer = await reader.readexactly(length)
            latencies.append(time.perf_counter() - t)
            assert status == 200, answer[:300]
    finally:
        writer.close()


def http_fresh(port: int, batches: list[list[str]]) -> dict:
    """POST every batch on a connection of its own, one after another: latency (the
    connection's set-up included), rows/s."""
    bodies = [json.dumps({"rows": b}).encode() for b in batches]
    latencies: list[float] = []

    async def run() -> None:
        for body in bodies:
            t = time.perf_counter()
            await _keep_alive_client(port, [body], [])
            latencies.append(time.perf_counter() - t)

    t0 = time.perf_counter()
    asyncio.run(run())
    return _stats(latencies, sum(len(b) for b in batches), time.perf_counter() - t0)


def http_keep_alive(port: int, batches: list[list[str]], connections: int) -> dict:
    """POST every batch over ``connections`` keep-alive connections at once (batches dealt out
    in turn); latency per request, rows/s overall."""
    bodies = [json.dumps({"rows": b}).encode() for b in batches]
    latencies: list[float] = []

    async def run() -> None:
        await asyncio.gather(*(_keep_alive_client(port, bodies[i::connections], latencies) for i in range(connections)))

    t0 = time.perf_counter()
    asyncio.run(run())
    return _stats(latencies, sum(len(b) for b in batches), time.perf_counter() - t0)


def timed(fn, reps: int, rows: int) -> dict:
    """p50 / p99 ms and rows/s of ``reps`` calls of ``fn`` (after one for warm-up)."""
    fn()  # warm-up
    t0 = time.perf_counter()
    latencies = harness.seconds(fn, reps)
    return _stats(latencies, rows * reps, time.perf_counter() - t0)


def converted(m, lines: list[str], tmp: Path):
    """The rows converted as predict converts them: (model batch, (dense, values, lengths) for
    the TorchScript module)."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    import torch

    from recsys_dist.data.loader import ParquetBatchLoader
    from recsys_dist.serve.score_inputs import prepare_for_scoring

    raw = tmp / f"rows{len(lines)}.txt"
    raw.write_text("\n".join(lines) + "\n")
    data = m.job.data.model_copy(update={"cache_dir": str(tmp / "cache")})
    vocab = m.preprocessing.vocabulary if m.preprocessing else None
    parquet = prepare_for_scoring(data, raw, vocab).files["train"]
    f = m.job.features
    dense_names, sparse_names = f.dense_names, f.keys
    loader = ParquetBatchLoader(
        str(parquet),
        len(lines),
        0,
        1,
        dense_names,
        sparse_names,
        num_embeddings=f.id_bounds,
        label_columns=f.label_columns,
    )
    batch = next(iter(loader))
    table = pq.read_table(parquet)
    dense = torch.from_numpy(np.stack([table[n].to_numpy() for n in dense_names], 1).astype(np.float32))
    values, lengths = [], []
    for name in sparse_names:
        col = table[name].combine_chunks()
        if str(col.type).startswith("list"):
            values.append(col.flatten().to_numpy())
            lengths.append(pc.list_value_length(col).to_numpy())
        else:
            values.append(col.to_numpy())
            lengths.append(np.ones(len(col), np.int64))
    ts_inputs = (dense, torch.from_numpy(np.concatenate(values)), torch.from_numpy(np.concatenate(lengths)))
    return batch, ts_inputs


def in_process(export: Path, lines: list[str], reps: dict[int, int]) -> dict:
    """The in-process rows (module doc) at each batch size."""
    import numpy as np
    import torch

    from recsys_dist.serve.export import load
    from recsys_dist.serve.inmemory import row_scorer
    from recsys_dist.serve.request_rows import score_rows

    m = load(export)
    ts_path = export / "model.torchscript.pt"
    ts = torch.jit.load(str(ts_path)) if ts_path.is_file() else None
    out: dict = {}
    scorer = row_scorer(m)  # chosen once per model, as the server does
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for n in BATCHES:
            rows = lines[:n]
            batch, ts_inputs = converted(m, rows, Path(tmp))
            objects = servers.criteo_objects(rows)
            assert scorer.kind == "in-memory" and np.allclose(
                scorer(objects)["logits"], score_rows(m, rows)["logits"], atol=1e-6
            )
            out[("in-memory, lines", n)] = timed(lambda rows=rows: scorer(rows), reps[n] * 5, n)
            out[("in-memory, objects", n)] = timed(lambda rows=objects: scorer(rows), reps[n] * 5, n)
            out[("score_rows (file route)", n)] = timed(lambda rows=rows: score_rows(m, rows), reps[n], n)
            out[("forward", n)] = timed(lambda b=batch: m.model(b), reps[n] * 5, n)
            if ts is not None:
                out[("torchscript", n)] = timed(lambda x=ts_inputs: ts(*x), reps[n] * 5, n)
                logits = m.model(batch)[1][1].numpy()  # the artefact scores the same rows the same
                assert np.allclose(ts(*ts_inputs).numpy(), logits, atol=1e-5)
    return out


# A server as served before the fix: its listening socket without IPPROTO_TCP (asyncio then
# leaves Nagle's algorithm on for accepted connections) and the protocol's own no_delay off.
NAGLE_ON = """
import socket, sys
import recsys_dist.cli.serve as cli_serve
import recsys_dist.serve.connections as connections
connections.no_delay = lambda transport: None
def listening_socket(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    return s
cli_serve.listening_socket = listening_socket
from recsys_dist.cli.main import main
sys.exit(main())
"""


def _http_rows(port: int, lines: list[str], reps: dict[int, int], connections: list[int], tag: str) -> dict:
    out = {}
    for n in BATCHES:
        http_keep_alive(port, _batches(lines, n, 3), 1)  # warm-up
        for c in connections:
            batches = _batches(lines, n, max(reps[n], 2 * c))
            out[(f"{tag}HTTP keep-alive, {c} connection{'s' if c > 1 else ''}", n)] = http_keep_alive(port, batches, c)
        out[(f"{tag}HTTP, a new connection per request", n)] = http_fresh(port, _batches(lines, n, reps[n]))
    return out


def http_all(export: Path, lines: list[str], reps: dict[int, int], connections: list[int]) -> dict:
    """The HTTP rows of one server of ``export``."""
    with servers.running(export) as (_, port):
        return _http_rows(port, lines, reps, connections, "")


def compare_nagle(export: Path, lines: list[str], reps: dict[int, int], connections: list[int], rounds: int) -> dict:
    """Keep-alive rows of a server with Nagle on (before) and one as served now (after), the
    same export, interleaved rounds (ABBA); latencies pooled over the rounds per row."""
    pooled: dict = {}
    with servers.running(export, python_code=NAGLE_ON) as (_, before), servers.running(export) as (_, after):
        ports = {"before (Nagle on): ": before, "after: ": after}
        rows = {
            tag: (lambda tag=tag, port=port: _http_rows(port, lines, reps, connections, tag))
            for tag, port in ports.items()
        }
        for rounds_of_one in harness.abba(rows, rounds).values():
            for got in rounds_of_one:
                for key, r in got.items():
                    pooled.setdefault(key, []).append(r)
    return {k: _pool(rs) for k, rs in pooled.items()}


def _pool(results: list[dict]) -> dict:
    """Rounds of one row as one: the median of their p50s and the largest p99, rows/s averaged."""
    return {
        "p50_ms": harness.median([r["p50_ms"] for r in results]),
        "p99_ms": max(r["p99_ms"] for r in results),
        "rows_s": sum(r["rows_s"] for r in results) / len(results),
    }


def table(results: dict) -> str:
    ways = list(dict.fromkeys(w for w, _ in results))
    head = "| route | " + " | ".join(f"batch {n}: p50 / p99 ms, rows/s" for n in BATCHES) + " |"
    lines = [head, "| --- |" + " ---: |" * len(BATCHES)]
    for w in ways:
        cells = []
        for n in BATCHES:
            r = results.get((w, n))
            cells.append("-" if r is None else f"{r['p50_ms']:.2f} / {r['p99_ms']:.2f}, {r['rows_s']:,.0f}")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "serve_load", "2 requests a batch size, 1 and 2 connections, 1 round")
    p.add_argument("export", type=Path, help="an export directory of a criteo_tsv model")
    p.add_argument("--requests", type=int, default=200, help="requests at batch 1 (fewer at larger batches)")
    p.add_argument("--connections", default="1,4,16,64", help="keep-alive connections at once, e.g. 1,4,16,64")
    p.add_argument("--compare-nagle", action="store_true", help="a server with Nagle on vs as served now")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of --compare-nagle")
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    lines = harness.SAMPLE.read_text().splitlines()[9000:]  # the quickstart's test rows
    reps = {1: args.requests, 64: max(args.requests // 4, 10), 512: max(args.requests // 10, 10)}
    if args.smoke:
        reps, args.connections, args.rounds = dict.fromkeys(BATCHES, 2), "1,2", 1
    connections = [int(c) for c in args.connections.split(",")]
    with harness.Results(args, argv, path=args.out) as res:
        if args.compare_nagle:
            results = compare_nagle(args.export, lines, reps, connections, args.rounds)
        else:
            results = in_process(args.export, lines, reps)
            results.update(http_all(args.export, lines, reps, connections))
        res.markdown = table(results)
        print(res.markdown)
        print(json.dumps({f"{w} b={n}": r for (w, n), r in results.items()}))


if __name__ == "__main__":
    main()
