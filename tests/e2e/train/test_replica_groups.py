"""Issue 38 item 4 from the CLI: ``recsys-dist train ... sharding.replica_groups=2`` on the
quickstart (2 ranks: 2 groups of 1, every table whole on each rank; TrainPipelineSparseDist,
validation, keep_best checkpoints, export) with exact_sgd trains as one group does (also with
``distributed.dense.strategy=fsdp``, against one group under ddp), and its
export is one unsharded model equal to one group's; ``replica_sync_every=1000`` (no sync while
training, then the one before the validation and the checkpoint) runs too, close to it. That
the Trainer syncs before scoring and saving is checked exactly in
tests/ranks/distributed/test_replica_groups.py (the replicas agree after each). Pipeline stages
in 2 groups of 2 at 4 ranks log one group's ddp run and resume under it."""

from safetensors.torch import load_file

from tests.cli import read_metrics, run_cli, run_train
from tests.conftest import QUICKSTART

STEPS = [
    "train.max_steps=30",
    "train.log_every_n_steps=10",
    "checkpoint.keep_best=true",
    "train.embedding_optimizer=exact_sgd",
]
RUNS = {
    "one": (),
    "two": ("sharding.replica_groups=2",),
    "lazy": ("sharding.replica_groups=2", "sharding.replica_sync_every=1000"),
    # the dense tower under FSDP2 over both ranks (across the 2 groups), against one group under ddp
    "fsdp": ("sharding.replica_groups=2", "distributed.dense.strategy=fsdp"),
}


def test_replica_groups_run_and_export_match_one_group(tmp_path):
    runs = {}
    for name, extra in RUNS.items():
        run = tmp_path / name
        r = run_train(QUICKSTART, run, *STEPS, *extra, tmp=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        out = tmp_path / f"{name}.export"
        e = run_cli(["export", str(run), "--out", str(out)], tmp_path)
        assert e.returncode == 0, e.stderr[-3000:]
        runs[name] = (read_metrics(run), load_file(str(out / "model.safetensors")), read_metrics(run, "ledger")[0])
    one_w = runs["one"][1]
    losses = {s: [m["loss"] for m in runs[s][0] if m["split"] == "train"] for s in runs}
    assert len(losses["one"]) == 3
    val = {s: [m["auc"] for m in runs[s][0] if m["split"] == "validation"] for s in runs}
    two_w, lazy_w = runs["two"][1], runs["lazy"][1]
    assert two_w.keys() == lazy_w.keys() == one_w.keys() == runs["fsdp"][1].keys()
    for s in ("two", "fsdp"):
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(losses[s], losses["one"], strict=True)), losses
        assert val["one"] and all(abs(a - b) < 1e-6 for a, b in zip(val[s], val["one"], strict=True)), val
        # export: measured 4.2e-7 (two), 3.3e-7 (fsdp)
        assert max((runs[s][1][k] - v).abs().max().item() for k, v in one_w.items()) < 1e-6, s
    # Local SGD over 30 steps: the tables drift a little (measured 7.6e-5); the dense tower's Adagrad
    # turns the slightly different gradients of weights whose gradients are ~0 into steps of the
    # learning rate's size (measured 0.099), so it is not compared.
    tables = [k for k in one_w if "embedding_bags" in k]
    assert tables and max((lazy_w[k] - one_w[k]).abs().max().item() for k in tables) < 5e-4
    assert runs["lazy"][2]["replica_sync_every"] == 1000
    # the run's ledger: one group's all-to-alls (1 rank: none) and the sync's all-reduce
    ledger = runs["two"][2]
    assert ledger["replica_groups"] == 2 and ledger["world_size"] == 1
    assert ledger["sync_bytes_per_rank"][0] > 0 and ledger["totals"]["replica_sync"] > 0
    # fsdp's gather and reduce-scatter go between the job's 2 ranks, not within a group of 1
    # (the ledger counted none before); DDP's all-reduce of the tower is gone
    fsdp = runs["fsdp"][2]["totals"]
    assert fsdp["fsdp_all_gather"] > 0 and fsdp["fsdp_reduce_scatter"] > 0 and fsdp["allreduce"] == 0
    assert ledger["totals"]["allreduce"] > 0  # ddp's, over the job's 2 ranks


def test_pipeline_in_groups_at_four_ranks_logs_one_groups_ddp_run(tmp_path):
    """``distributed.dense.strategy=pipeline`` (2 stages) in 2 replica groups of 2 at 4 ranks, from
    the CLI (preflight, the Trainer's step, validation, checkpoints, the run's ledger line): the
    losses and validation AUC of one group of 4 under ddp, and its step-20 checkpoint resumed
    under ddp in one group ends where it ended; its export is ddp's model (refused before: pipeline
    with replica groups)."""
    common = [
        "train.max_steps=30",
        "train.log_every_n_steps=10",
        "checkpoint.every_n_steps=10",
        "eval.every_n_steps=10",
        "train.embedding_optimizer=exact_sgd",
        "distributed.nproc_per_node=4",
        "train.batch_size=16",
    ]
    pipe = ["sharding.replica_groups=2", "distributed.dense.strategy=pipeline", "distributed.dense.stages=2"]
    runs = {"ddp": [], "pipe": pipe, "resumed": ["--resume", str(tmp_path / "pipe" / "checkpoints" / "step_00000020")]}
    for name, extra in runs.items():
        r = run_train(QUICKSTART, tmp_path / name, *common, *extra, tmp=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
    got = {
        n: {s: [m.get(k) for m in read_metrics(tmp_path / n, s)] for s, k in (("train", "loss"), ("validation", "auc"))}
        for n in runs
    }
    assert len(got["ddp"]["train"]) == 3 and len(got["ddp"]["validation"]) == 3
    for name, want in (("pipe", got["ddp"]), ("resumed", {s: v[-1:] for s, v in got["ddp"].items()})):
        for split, values in want.items():
            assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got[name][split], values, strict=True)), got
    ledger = read_metrics(tmp_path / "pipe", "ledger")[0]  # a sharding group's rows, the stages' bytes in them
    assert ledger["world_size"] == 2 and all(r["pipeline_p2p"]["sent"] > 0 for r in ledger["per_rank"])
    exported = {}
    for name in ("ddp", "pipe"):  # one unsharded model: every stage, the tables whole
        e = run_cli(["export", str(tmp_path / name), "--out", str(tmp_path / f"{name}.export")], tmp_path)
        assert e.returncode == 0, e.stderr[-3000:]
        exported[name] = load_file(str(tmp_path / f"{name}.export" / "model.safetensors"))
    assert exported["pipe"].keys() == exported["ddp"].keys()
    # measured 1.0e-6 in the tower, as pipeline in one group of 4 against ddp (its microbatch sums
    # round differently, which dense Adagrad magnifies); tables 6e-8
    assert max((exported["pipe"][k] - v).abs().max().item() for k, v in exported["ddp"].items()) < 1e-5
