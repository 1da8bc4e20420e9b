import pytest
import torch

from tests.cli import run_cli
from tests.conftest import QUICKSTART


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
    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.distributed.tables import init_tables
    from recsys_dist.train.build import build_task

    job = resolve_job(load_config(QUICKSTART, ["data.num_rows=1000"]))
    init = build_task(job, job.features.on(torch.device("cpu"), torch.device("cpu"))).state_dict()
    tables = job.features.planned_tables()
    init_tables(init, tables, job.train.seed, {t.name: t.weight_init_max for t in tables})
    key = "model.sparse_arch.embedding_bag_collection.embedding_bags.t_C1.weight"
    plain = (moved["plain"][key] - init[key]).abs().sum()
    warm = (moved["warmup"][key] - init[key]).abs().sum()
    assert plain > 0 and warm < 0.05 * plain
