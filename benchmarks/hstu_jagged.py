"""HSTU's layers on packed tokens (``recsys_dist.models.hstu_jagged``) against the padded layers
they replaced: one training step of the shipped HSTU on CPU, per history length L, with
MovieLens's own history lengths and with every row full.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/hstu_jagged.py [--lengths 50 200 800]
        [--batch 64] [--rounds 5] [--steps 2] [--contenders padded jagged] [--record]

The model is configs/movielens_hstu.yaml (two layers, two heads, the rating action tokens;
dropout 0) unsharded in this process (1 intra-op thread; hashed ids, 10,000 rows a table).
``padded`` is the same model with ``HSTU.encode`` replaced by the computation before the jagged
layers (``target_layout`` and ``HSTULayer.forward`` over the batch padded to its longest
history, the attention kernel ``auto``); ``jagged`` is the model as it is; ``jagged_dense`` /
``jagged_chunked`` set ``model.attention`` (blocks kept for backward / recomputed).
Histories: ``movielens`` draws the batch's rows from the users of
/work/shared/data/movielens/ratings.csv (uniformly, seeded), each row's length its user's count
of ratings capped at L (many users short, few long); ``full``: every row L (no padding: the
jagged layers' overhead). A step is forward, backward and an SGD step. Per (L, histories) the
contenders run ``--rounds`` rounds in ABBA order (``harness.abba``), ``--steps`` steps each
after a warm-up step: median ms per step and the paired ratio to ``padded``. Peak memory: each
again in a fresh process, the resident set's growth over two steps after a warm-up
(``sequence_cost.peak_growth``'s sampling).
"""

from __future__ import annotations

import functools
import multiprocessing
import threading
import time
import types

import harness
import sequence_cost

RATINGS = "/work/shared/data/movielens/ratings.csv"
CONTENDERS = {
    "padded": [],
    "jagged": [],
    "jagged_dense": ["model.attention=dense"],
    "jagged_chunked": ["model.attention=chunked"],
}


def padded_encode(self, stack, values, mask, target, deltas=None):
    """``HSTU.encode`` before the jagged layers: every layer over the padded ``[B, L + 1, E]``."""
    import torch

    from recsys_dist.models import hstu_time
    from recsys_dist.models.zoo.hstu import target_layout

    weight, history_bucket, target_bucket = target_layout(mask, self.max_positions)
    buckets = hstu_time.time_buckets(deltas, self.time_buckets) if deltas is not None else None
    x = torch.cat([values, target.unsqueeze(1)], dim=1)
    for layer in stack:
        x = layer(x, weight, history_bucket, target_bucket, buckets)
    return x[:, -1, :]


def user_lengths(cap: int, batch: int, seed: int) -> list[int]:
    """``batch`` rows' history lengths: users drawn uniformly from ``RATINGS``, each user's count
    of ratings capped at ``cap``."""
    import numpy as np
    import pyarrow.csv

    users = pyarrow.csv.read_csv(RATINGS).column("userId").to_numpy()
    counts = np.unique(users, return_counts=True)[1]
    return np.minimum(np.random.default_rng(seed).choice(counts, batch), cap).tolist()


def build(name: str, lengths: list[int]):
    """(model in train mode, its SGD optimizer, one batch of ``len(lengths)`` rows)."""
    import torch
    from torchrec import KeyedJaggedTensor

    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.data.loader import CTRBatch
    from recsys_dist.models.build import build_model

    torch.set_num_threads(1)
    overrides = ["data.categorical_mapping=hash", "data.num_embeddings=10000", "distributed.nproc_per_node=1"]
    cfg = load_config(
        harness.CONFIGS / "movielens_hstu.yaml", [*overrides, "model.layer_dropout=0.0", *CONTENDERS[name]]
    )
    job = resolve_job(cfg)
    torch.manual_seed(0)
    model = build_model(job.model, job.features.on(torch.device("cpu")), job.train).train()
    if name == "padded":
        hstu = next(m for m in model.modules() if hasattr(m, "stacks"))
        hstu.encode = types.MethodType(padded_encode, hstu)
    batch, keys = len(lengths), job.features.keys
    per_key = [lengths if k.startswith("history") else [1] * batch for k in keys]  # history and history_action
    flat = torch.tensor([n for key in per_key for n in key])
    g = torch.Generator().manual_seed(sum(lengths))
    kjt = KeyedJaggedTensor(
        keys=keys, values=torch.randint(1, 10000, (int(flat.sum()),), generator=g), lengths=flat, stride=batch
    )
    data = CTRBatch(torch.zeros(batch, 0), kjt, torch.randint(0, 2, (batch,), generator=g).float(), torch.ones(batch))
    return model, torch.optim.SGD(model.parameters(), lr=0.01), data


def peak_growth(name: str, lengths: list[int]) -> float:
    """In a fresh process: MiB the resident set grows at most over two steps above what it is
    before them (after a warm-up step), sampled every millisecond."""
    model, opt, data = build(name, lengths)
    sequence_cost.step(model, opt, data)
    before, peak, done = sequence_cost.rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], sequence_cost.rss_mib())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    for _ in range(2):
        sequence_cost.step(model, opt, data)
    done.set()
    t.join()
    return max(peak[0], sequence_cost.rss_mib()) - before


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "hstu_jagged", "lengths 8 and 16, batch 8, 2 rounds of 1 step")
    p.add_argument("--lengths", type=int, nargs="+", default=[50, 200, 800])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--histories", nargs="+", choices=["movielens", "full"], default=["movielens", "full"])
    p.add_argument("--contenders", nargs="+", choices=list(CONTENDERS), default=["padded", "jagged"])
    args = p.parse_args(argv)
    if "padded" not in args.contenders:
        p.error("--contenders needs padded (the ratios' baseline)")
    if args.smoke:
        args.lengths, args.batch, args.rounds, args.steps = [8, 16], 8, 2, 1
    with harness.Results(args, argv, title="HSTU padded vs jagged layers: training step cost"):
        run(args)


def same_loss(built: dict) -> None:
    """Refuse to time contenders whose first loss (the same seeded weights and batch) differs."""
    import torch

    with torch.no_grad():
        losses = {n: float(model(data)[0]) for n, (model, _, data) in built.items()}
    if max(losses.values()) - min(losses.values()) > 1e-5:
        raise SystemExit(f"the contenders' losses differ: {losses}")


def run(args) -> None:
    names, others = args.contenders, [n for n in args.contenders if n != "padded"]
    print(f"batch {args.batch} rows; ms per step (median of {args.rounds} rounds x {args.steps} steps)\n")
    head = ["L", "histories", "mean / max length", *(f"{n} ms" for n in names), *(f"{n} / padded" for n in others)]
    print("| " + " | ".join([*head, f"peak growth MiB ({', '.join(names)})"]) + " |")
    print("| --- " * (len(head) + 1) + "|")
    ctx = multiprocessing.get_context("spawn")
    for length in args.lengths:
        for histories in args.histories:
            lengths = (
                user_lengths(length, args.batch, seed=length) if histories == "movielens" else [length] * args.batch
            )
            built = {n: build(n, lengths) for n in names}
            same_loss(built)
            for n in names:
                sequence_cost.step(*built[n])  # warm-up
            ms = harness.abba(
                {n: functools.partial(sequence_cost.timed, built[n], args.steps) for n in names}, args.rounds
            )
            del built
            peaks = []
            for n in names:
                with ctx.Pool(1) as pool:
                    peaks.append(pool.apply(peak_growth, (n, lengths)))
            ratios = [
                f"{harness.paired_ratio(ms[n], ms['padded']):.2f} {harness.ratio_interval(ms[n], ms['padded'])}"
                for n in others
            ]
            shape = f"{sum(lengths) / len(lengths):.0f} / {max(lengths)}"
            row = [str(length), histories, shape, *(f"{harness.median(ms[n]):.1f}" for n in names), *ratios]
            print("| " + " | ".join([*row, ", ".join(f"{x:.0f}" for x in peaks)]) + " |", flush=True)


if __name__ == "__main__":
    main()
