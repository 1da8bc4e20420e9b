import pytest
import torch

from recsys_dist.train.schedule import LRSchedule
from tests.cli import run_cli
from tests.conftest import QUICKSTART


def test_warmup_then_polynomial_decay_then_hold():
    s = LRSchedule(warmup_steps=4, decay_start_step=10, decay_steps=4)
    assert [s.scale(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s.scale(9) == 1.0
    assert [s.scale(i) for i in (10, 11, 12, 13, 14, 20)] == [1.0, 0.5625, 0.25, 0.0625, 0.0, 0.0]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    s.apply(opt, [0.1], 14)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-7)  # floored at min_lr
    assert not LRSchedule().active


@pytest.mark.slow
def test_schedule_reaches_the_fused_embedding_update(tmp_path):
    """A 1000-step warmup scales the fused (FBGEMM) table updates of the first 10 steps by
    ~1/1000..1/100, so the tables move far less than without it."""
    from safetensors.torch import load_file

    moved = {}
    for name, extra in {"plain": [], "warmup": ["train.warmup_steps=1000"]}.items():
        run = tmp_path / name
        r = run_cli(
            [
                "train",
                "--config",
                str(QUICKSTART),
                "--run-dir",
                str(run),
                "data.num_rows=1000",
                "train.max_steps=10",
                "distributed.nproc_per_node=1",
                "train.progress_bar=false",
                "train.dense_grad_clip_norm=1.0",
                *extra,
            ],
            tmp_path,
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert run_cli(["export", str(run), "--out", str(run / "export")], tmp_path).returncode == 0
        moved[name] = load_file(str(run / "export" / "model.safetensors"))
    from recsys_dist.config.loader import load_config
    from recsys_dist.distributed.tables import init_tables
    from recsys_dist.models.build import build_model, embedding_configs

    cfg = load_config(QUICKSTART, ["data.num_rows=1000"])
    init = build_model(cfg, torch.device("cpu"), tables_device=torch.device("cpu")).state_dict()
    tables = embedding_configs(cfg)
    init_tables(init, tables, cfg.train.seed, {t.name: t.weight_init_max for t in tables})
    key = "model.sparse_arch.embedding_bag_collection.embedding_bags.t_C1.weight"
    plain = (moved["plain"][key] - init[key]).abs().sum()
    warm = (moved["warmup"][key] - init[key]).abs().sum()
    assert plain > 0 and warm < 0.05 * plain
