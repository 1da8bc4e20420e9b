"""A Job rebuilt from the config tree a run wrote (``load_job``, what serve uses, without
RunConfig) is the Job the run resolved from its RunConfig (``resolve_job``)."""

import pytest
import yaml

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.train.job import load_job
from tests.conftest import QUICKSTART, ROOT


def _facts(job) -> dict:
    f = job.features
    return {
        "tables": [
            (t.name, t.num_embeddings, t.embedding_dim, getattr(t, "pooling", None)) for t in f.planned_tables()
        ],
        "names": (f.dense_names, f.sparse_names, f.sequence_names, f.keys, f.id_bounds),
        "tasks": (f.tasks, f.task_kinds, f.label_columns, f.weight_column, f.managed),
        "model": job.model_spec.name if job.model_spec else None,
        "fmt": (job.fmt.name, list(job.fmt.sparse_names)),
        "world": job.world,
    }


# quickstart (dlrm, criteo); deepfm's on_features hook (w_ tables); din's sequence tables
@pytest.mark.parametrize(
    "path",
    [QUICKSTART, ROOT / "configs" / "movielens_deepfm.yaml", ROOT / "configs" / "movielens_din.yaml"],
    ids=lambda p: p.stem,
)
def test_load_job_of_the_written_config_is_the_resolved_job(tmp_path, path):
    want = resolve_job(load_config(path))
    want.save_config(tmp_path / "config.yaml")
    tree = yaml.safe_load((tmp_path / "config.yaml").read_text())
    got = load_job(tree, str(tmp_path / "config.yaml"))
    assert got.sections() == want.sections() and got.to_dict() == want.to_dict()
    assert _facts(got) == _facts(want)
    # sized as a record says, as resolve_job sizes it
    sizes = [7 + i for i in range(len(want.fmt.sparse_names))]
    assert _facts(load_job(tree, "config.yaml", sizes=sizes)) == _facts(resolve_job(load_config(path), sizes=sizes))


def test_load_job_names_the_source_and_every_bad_section(tmp_path):
    tree = resolve_job(load_config(QUICKSTART)).to_dict()
    tree["train"]["batch_size"] = 0
    tree["model"]["dropout"] = 0.5  # dlrm takes none
    tree["trian"] = {}
    with pytest.raises(ConfigError) as err:
        load_job(tree, "run/config.yaml")
    text = str(err.value)
    assert "run/config.yaml" in text and "train.batch_size" in text and "model.dropout" in text
    assert "trian: unknown sections" in text
    with pytest.raises(ConfigError, match="invalid config meta.json: no data section"):
        load_job({"model": {}}, "meta.json")
