"""Issue 17 item 3: the last, padded global batch weighs each real row once, at any world size.

800 training rows, global batch 96: the 9th batch of each epoch holds 32 real rows. On 2 ranks
(48 per rank) rank 1 holds only padding, on 3 ranks (32 per rank) ranks 1 and 2 do. The loss of
every step (train.log_every_n_steps: 1), the final weights and the validation and test metrics
must be those of 1 rank (1e-5; weights 1e-4), with data.remainder pad and drop. Before the fix the padded step's loss
on 2 ranks was half the 1-rank loss.

Sample weights (issue 18): the same spawn also trains the two-task MMoE config with a weight
column of uneven weights at 1, 2 and 3 ranks: every step's loss and per-task losses
(``loss/like``, ``loss/rating``) and the test metrics must be those of 1 rank (1e-5), i.e. the
loss is ``sum w_i l_i / sum w_i`` over the whole global batch. Before the fix each rank's loss
was scaled by its real-row share, not its weight share: the 2-rank losses differed from 1
rank by up to 0.044 (2.4e-7 after).
"""

import pytest
import torch

from recsys_dist.testing import run_ranks
from tests.cli import read_metrics
from tests.ranks.train.padded_worker import train_pad_and_drop, write_weighted_ratings


def step_losses(run_dir, key="loss"):
    return {m["step"]: m[key] for m in read_metrics(run_dir, "train")}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_padded_last_batch_is_world_size_exact(tmp_path):
    cache = str(tmp_path / "cache")
    write_weighted_ratings(tmp_path / "weighted.csv")
    runs = {ws: run_ranks(train_pad_and_drop, ws, cache, str(tmp_path), timeout_s=900)[0] for ws in (1, 2, 3)}
    check_weighted(tmp_path, runs)
    for remainder, steps in (("pad", 18), ("drop", 16)):
        ref = step_losses(tmp_path / f"{remainder}-1")
        assert sorted(ref) == list(range(1, steps + 1))
        for ws in (2, 3):
            got = step_losses(tmp_path / f"{remainder}-{ws}")
            assert sorted(got) == sorted(ref), (remainder, ws)
            for step in ref:
                assert got[step] == pytest.approx(ref[step], abs=1e-5), (remainder, ws, step)
            a, b = runs[1][remainder], runs[ws][remainder]
            for split in ("validation", "test"):
                for key in ("auc", "logloss"):
                    assert b["summary"][split][key] == pytest.approx(a["summary"][split][key], abs=1e-5), (
                        remainder,
                        ws,
                        split,
                        key,
                    )
            assert (
                b["summary"]["rows_trained"] == a["summary"]["rows_trained"] == (1600 if remainder == "pad" else 1536)
            )
            wa, wb = a["weights"], b["weights"]
            assert sorted(wa) == sorted(wb)
            for name in wa:
                # 1e-4: float32 reduction order moves one dense weight by 2.6e-5 (Adagrad divides by a
                # small accumulator) on 2 ranks also under drop, with no padding at all.
                torch.testing.assert_close(wb[name], wa[name], atol=1e-4, rtol=0, msg=f"{remainder} {ws} {name}")


def check_weighted(tmp_path, runs):
    ref = {k: step_losses(tmp_path / "weighted-1", k) for k in ("loss", "loss/like", "loss/rating")}
    assert len(ref["loss"]) >= 16  # 2 epochs of ~9 global batches of 96, the last padded
    for ws in (2, 3):
        for key, want in ref.items():
            got = step_losses(tmp_path / f"weighted-{ws}", key)
            assert sorted(got) == sorted(want), (ws, key)
            for step in want:
                assert got[step] == pytest.approx(want[step], abs=1e-5), (ws, key, step)
        a, b = runs[1]["weighted"]["summary"], runs[ws]["weighted"]["summary"]
        for split in ("validation", "test"):
            for key in ("like/auc", "like/logloss", "rating/rmse", "rating/mae"):
                assert b[split][key] == pytest.approx(a[split][key], abs=1e-5), (ws, split, key)
