"""Cost of the history models against the history's length: HSTU (2 layers as shipped, and 1)
against BST (1 transformer block as shipped), one training step on CPU; or HSTU's attention
kernels against each other (``--models hstu_dense hstu_chunked --baseline hstu_dense``).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/sequence_cost.py [--lengths 50 200 800]
        [--batch 64] [--rounds 5] [--steps 3] [--models hstu hstu_1layer bst] [--baseline bst]
        [--record]

Each model is configs/movielens_hstu.yaml / movielens_bst.yaml unsharded in this process (1
intra-op thread; hashed ids, 10,000 rows a table), on in-memory batches of ``--batch`` rows whose
histories all hold exactly L events (the padded worst case: no row is shorter than the longest).
A step is forward, backward and a plain SGD step over every parameter. Per L, the contenders run
``--rounds`` rounds in ABBA order (``harness.abba``), ``--steps`` steps each, after one warm-up
step: the median milliseconds per step and the paired ratio to ``--baseline`` within a round (the load of
other processes hits both sides of a round alike). Peak memory: each (model, L) again in a fresh
process, how far its resident set grows over two steps above what it is before them, after
a warm-up step (the peak resident set sampled every millisecond by a thread: the step's
activations and gradients, not the model's weights).
"""

from __future__ import annotations

import functools
import multiprocessing
import resource
import time

import harness

MODELS = {  # contender: (config, overrides)
    "hstu": ("movielens_hstu.yaml", ["model.layer_dropout=0.0"]),
    "hstu_1layer": ("movielens_hstu.yaml", ["model.layer_dropout=0.0", "model.num_layers=1"]),
    "bst": ("movielens_bst.yaml", ["model.transformer_dropout=0.0"]),
    # the attention kernels of recsys_dist.models.hstu_attention ("hstu" above is model.attention: auto)
    "hstu_dense": ("movielens_hstu.yaml", ["model.layer_dropout=0.0", "model.attention=dense"]),
    "hstu_chunked": ("movielens_hstu.yaml", ["model.layer_dropout=0.0", "model.attention=chunked"]),
}


def build(name: str, batch: int, length: int):
    """(model in train mode, its SGD optimizer, one batch) for ``name`` at history length ``length``."""
    import torch
    from torchrec import KeyedJaggedTensor

    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.data.loader import CTRBatch
    from recsys_dist.models.build import build_model

    torch.set_num_threads(1)
    config, overrides = MODELS[name]
    cfg = load_config(
        harness.CONFIGS / config,
        ["data.categorical_mapping=hash", "data.num_embeddings=10000", "distributed.nproc_per_node=1", *overrides],
    )
    job = resolve_job(cfg)
    torch.manual_seed(0)
    model = build_model(job.model, job.features.on(torch.device("cpu")), job.train).train()
    g = torch.Generator().manual_seed(length)
    keys = list(job.features.keys)  # the history's (and, with actions, history_action's) rows hold L ids
    lengths = torch.cat([torch.full((batch,), length if k.startswith("history") else 1) for k in keys])
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.randint(0, 10000, (int(lengths.sum()),), generator=g),
        lengths=lengths,
        stride=batch,
    )
    data = CTRBatch(torch.zeros(batch, 0), kjt, torch.randint(0, 2, (batch,), generator=g).float(), torch.ones(batch))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), data


def step(model, opt, data) -> None:
    loss = model(data)[0]
    loss.backward()
    opt.step()
    opt.zero_grad()


def timed(built: tuple, steps: int) -> float:
    """Milliseconds per step over ``steps`` steps of ``built`` (model, optimizer, batch)."""
    t = time.perf_counter()
    for _ in range(steps):
        step(*built)
    return (time.perf_counter() - t) / steps * 1000


def rss_mib() -> float:
    """The resident set now, MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def peak_growth_mib(name: str, batch: int, length: int) -> float:
    """In a fresh process: MiB the resident set grows at most over two steps (sampled every
    millisecond by a thread) above what it is before them."""
    import threading

    model, opt, data = build(name, batch, length)
    step(model, opt, data)  # the first step's one-off allocations (optimizer state, caches)
    before, peak, done = rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    for _ in range(2):
        step(model, opt, data)
    done.set()
    t.join()
    return max(peak[0], rss_mib()) - before


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "sequence_cost", "history lengths 8 and 16, batch 8, 2 rounds of 1 step")
    p.add_argument("--lengths", type=int, nargs="+", default=[50, 200, 800])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=["hstu", "hstu_1layer", "bst"])
    p.add_argument("--baseline", choices=list(MODELS), default="bst", help="the contender the ratios divide by")
    args = p.parse_args(argv)
    if args.baseline not in args.models:
        p.error(f"--baseline {args.baseline} is not one of --models {args.models}")
    if args.smoke:
        args.lengths, args.batch, args.rounds, args.steps = [8, 16], 8, 2, 1
    title = f"{', '.join(args.models)}: training step cost against the history length"
    with harness.Results(args, argv, title=title):
        run(args.lengths, args.batch, args.rounds, args.steps, args.models, args.baseline)


def run(lengths: list[int], batch: int, rounds: int, steps: int, names: list[str], baseline: str) -> None:
    others = [n for n in names if n != baseline]
    print(f"batch {batch} rows, every history of length L; ms per step (median of {rounds} rounds x {steps} steps)\n")
    print(
        "| L | "
        + " | ".join(f"{n} ms" for n in names)
        + "".join(f" | {n} / {baseline}" for n in others)
        + " | peak growth MiB ("
        + ", ".join(names)
        + ") |"
    )
    print("| --- " * (len(names) + len(others) + 2) + "|")
    ctx = multiprocessing.get_context("spawn")
    for length in lengths:
        built = {n: build(n, batch, length) for n in names}
        for n in names:
            step(*built[n])  # warm-up

        ms = harness.abba({n: functools.partial(timed, built[n], steps) for n in names}, rounds)
        del built
        peaks = []
        for n in names:
            with ctx.Pool(1) as pool:
                peaks.append(pool.apply(peak_growth_mib, (n, batch, length)))
        med = {n: harness.median(v) for n, v in ms.items()}
        ratios = [
            f"{harness.paired_ratio(ms[n], ms[baseline]):.2f} {harness.ratio_interval(ms[n], ms[baseline])}"
            for n in others
        ]
        row = [str(length), *(f"{med[n]:.1f}" for n in names), *ratios, ", ".join(f"{x:.0f}" for x in peaks)]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
