"""Issue 38 item 4: ``sharding.replica_groups`` (2-D sparse parallelism, TorchRec's DMPCollection
on CPU/gloo): tables sharded within groups of world / N ranks, replicated across the N groups,
averaged every ``replica_sync_every`` steps.

Against one group (the 1-D plan) on the same batches from the same seed: exact_sgd synced every
step gives the same losses (relative 1e-6; measured 0 here), for row_wise, table_wise and
column_wise, and data_parallel tables even under rowwise Adagrad (DDP averages them); exact_rowwise_adagrad does not (its accumulators are averaged, which is not the
accumulator of the summed gradient): measured, bounded, documented in
docs/design/replica_groups.md; syncing every 4 steps (local SGD) drifts too, a little. The ledger's sync
bytes are the bytes ``sync()`` all-reduces. A replica-groups checkpoint resumes under one group
and the reverse, continuing the losses exactly; the unsharded weights (export, publishing)
equal one group's.

Sequence (EmbeddingCollection) tables too (issue 38 item 6): configs/movielens_hstu.yaml at 2 x 2
against one group of 4, every sharding type a sequence table takes and the planner's choice:
the same losses and the same sequence tables after training (the sync averages their fused
shards as it does the pooled tables'; their all-to-all divides the gradient by the group's size
as the pooled one does); a checkpoint moves 2-D -> 1-D and 1-D -> 2-D.
"""

import pytest
import torch

from recsys_dist.testing import run_ranks
from tests.ranks.distributed import replica_seq_worker, replica_worker

TOL = 1e-6
STEPS = 8
SGD_CASES = [(["row_wise"], "exact_sgd", 1), (["table_wise"], "exact_sgd", 1), (["column_wise"], "exact_sgd", 1)]
# data_parallel tables are not in the sync: DDP averages their gradients over all ranks, so even
# rowwise Adagrad on them is exact.
EXACT_CASES = [*SGD_CASES, (["data_parallel"], "exact_rowwise_adagrad", 1)]
CASES = [*EXACT_CASES, (["row_wise"], "exact_rowwise_adagrad", 1), (["row_wise"], "exact_sgd", 4)]
# exact_rowwise_adagrad, 8 steps at 4 ranks in 2 groups: worst relative loss difference measured 1.4e-3.
ADAGRAD_GAP = 1e-2


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def _check_losses(results: list[dict], world_size: int, groups: int) -> dict:
    gaps: dict = {}
    for rank, res in enumerate(results):
        per_case = res["losses"]
        for types, optimizer, every in CASES:
            one = per_case[(tuple(types), optimizer, 1, 1)]
            two = per_case[(tuple(types), optimizer, every, groups)]
            assert one["type"] == "DistributedModelParallel" and two["type"] == "ReplicaDMP"
            assert len(set(one["losses"])) > 1  # it trains
            rel = _rel(two["losses"], one["losses"])
            gaps[(tuple(types), optimizer, every)] = max(rel, gaps.get((tuple(types), optimizer, every), 0))
            led = two["ledger"]
            assert led["world_size"] == world_size // groups  # the all-to-alls of one group
            synced = types != ["data_parallel"]  # data_parallel tables: DDP's, not the sync's
            assert led["sync_bytes"] == two["payload"] and (two["payload"] > 0) == synced, (rank, types, led)
            assert led["replica_sync"] == two["payload"] / every
            assert two["unsynced_after"] == STEPS % every
    for case in EXACT_CASES:
        assert gaps[(tuple(case[0]), case[1], 1)] <= TOL, (case, gaps)
    adagrad = gaps[(("row_wise",), "exact_rowwise_adagrad", 1)]
    assert TOL < adagrad < ADAGRAD_GAP, adagrad  # close, not equal (docs/design/replica_groups.md)
    # Local SGD: the replicas drift between syncs (measured 1.7e-7 here: SGD's update is linear in the
    # gradient, so only the gradients' dependence on the drifted weights differs; small at this lr).
    assert 0 < gaps[(("row_wise",), "exact_sgd", 4)] < ADAGRAD_GAP
    return gaps


def _check_checkpoints(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for types, c in res["checkpoints"].items():
            _check_checkpoint(rank, types, c)


def _check_checkpoint(rank: int, types: str, c: dict) -> None:
    half = len(c["replicas"])
    assert half < 5  # no step of the cadence (every 5) synced before either
    # the Trainer syncs before scoring (StepRunner.detach) and before saving (Checkpointer.save)
    assert not c["agree_before_detach"] and c["agree_after_detach"]
    assert not c["agree_before_save"] and c["agree_after_save"]
    assert not c["agree_before_own_save"] and c["agree_after_own_save"]  # recsys_dist.save_checkpoint
    assert _rel(c["replicas"], c["ref"][:half]) <= TOL, (rank, types)
    assert _rel(c["to_one"], c["ref"][half:]) <= TOL, (rank, types, c["to_one"], c["ref"][half:])
    assert _rel(c["to_groups"], c["ref"][half:]) <= TOL, (rank, types, c["to_groups"], c["ref"][half:])
    assert c["full_keys_equal"] and c["full_max_diff"] == 0.0
    assert c["memory_copy_diff"] == 0.0  # restore_best's copy in memory puts the shards back
    # DCP writes each shard once, not once per replica group; the disk-space check expects that
    (need, wrote), (need_one, wrote_one) = c["bytes"]["replicas"], c["bytes"]["one"]
    assert need == need_one and wrote <= 1.05 * wrote_one, c["bytes"]
    # the replicas' unsharded tables are the one-group model's that loaded them
    assert c["tables"].keys() == c["tables_one"].keys() and c["tables"]
    for k, v in c["tables"].items():
        assert (v - c["tables_one"][k]).abs().max().item() == 0.0, k


def test_replica_groups_at_four_ranks(tmp_path):
    """2 groups of 2 ranks."""
    results = run_ranks(replica_worker.everything, 4, str(tmp_path), CASES, STEPS, 2, timeout_s=900)
    gaps = _check_losses(results, 4, 2)
    print({k: f"{v:.2g}" for k, v in gaps.items()})
    _check_checkpoints(results)


@pytest.mark.slow
def test_replica_groups_at_two_ranks(tmp_path):
    """2 groups of 1 rank: every table whole on every rank, averaged by the sync (data parallel)."""
    results = run_ranks(replica_worker.everything, 2, str(tmp_path), CASES, STEPS, 2, timeout_s=900)
    _check_losses(results, 2, 2)
    _check_checkpoints(results)


SEQ_CASES = [[], ["row_wise"], ["table_wise"], ["column_wise"], ["data_parallel"]]  # []: the planner's choice
# Measured: rounding moves a sequence table row by 1.2e-7 against 8.5e-4 trained; without syncing
# the sequence tables (TorchRec's sync minus BatchedFusedEmbedding's TBEs) they differ by 1.3e-3.
SEQ_TABLE_GAP = 1e-3  # of what training moved them


def _table_gap(got: dict, want: dict, moved_from: dict) -> float:
    assert got.keys() == want.keys() == moved_from.keys() and len(got) == 2, got.keys()  # history, history_action
    moved = max((want[k] - moved_from[k]).abs().max().item() for k in want)
    assert moved > 1e-4, moved  # they train
    return max((got[k] - want[k]).abs().max().item() for k in want) / moved


def test_sequence_tables_at_four_ranks(tmp_path):
    """HSTU, 2 groups of 2 ranks, exact_sgd synced every step, against 1 group of 4."""
    results = run_ranks(replica_seq_worker.everything, 4, str(tmp_path), SEQ_CASES, STEPS, 2, timeout_s=900)
    for rank, res in enumerate(results):
        for types in SEQ_CASES:
            one, two = res["losses"][(tuple(types), 1)], res["losses"][(tuple(types), 2)]
            assert one["type"] == "DistributedModelParallel" and two["type"] == "ReplicaDMP"
            assert len(set(one["losses"])) > 1
            assert _rel(two["losses"], one["losses"]) <= TOL, (rank, types)
            seq = {t: two["types"][t] for t in replica_seq_worker.SEQUENCE_TABLES}
            assert set(seq.values()) == {types[0]} if types else set(seq.values()) <= {"row_wise", "table_wise"}
            assert all(torch.equal(two["tables_before"][k], v) for k, v in one["tables_before"].items())
            assert _table_gap(two["tables"], one["tables"], one["tables_before"]) <= SEQ_TABLE_GAP, (rank, types)
            # row_wise: every rank holds a shard of all 5 tables, all in the sync; data_parallel: none
            # (DDP's); the ledger counts the sequence tables' bytes as the sync moves them
            synced = {"row_wise": 5, "data_parallel": 0}.get(types[0] if types else "")
            assert synced is None or two["synced"] == synced, (rank, types, two["synced"])
            assert two["sync_bytes"] == two["payload"], (rank, types, two["sync_bytes"], two["payload"])
        c = res["checkpoints"]
        half = len(c["replicas"])
        assert _rel(c["replicas"], c["ref"][:half]) <= TOL
        assert not c["agree_before_save"] and c["agree_after_save"]  # the save syncs the unsynced step
        assert _rel(c["to_one"], c["ref"][half:]) <= TOL and _rel(c["to_groups"], c["ref"][half:]) <= TOL
        for key in ("to_one_tables", "to_groups_tables"):
            assert _table_gap(c[key], c["ref_tables"], res["losses"][(("row_wise",), 1)]["tables_before"]) <= (
                SEQ_TABLE_GAP
            ), (rank, key)
