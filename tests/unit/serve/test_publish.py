"""Publishing (recsys_dist.serve.publish): a full version, then deltas of the changed rows, folded
back bit for bit; int8 / int4 rows through TorchRec's quantized modules; resume and damage.

One 2-rank training run (gloo) of the quickstart's DLRM on 2,000 Criteo rows saves checkpoints at
steps 2, 4 and 6; every test publishes those checkpoints itself (a Publisher per test).
"""

import json

import pytest

from recsys_dist.config.loader import config_from_dict
from recsys_dist.errors import CheckpointError, ConfigError
from recsys_dist.serve.publish import Publisher, load_published
from recsys_dist.train.config import PublishConfig

FP32 = PublishConfig(enabled=True, every_n_steps=2)


def _cfg(publish):
    return config_from_dict({"data": {"format": "criteo_tsv", "raw_path": "x.txt"}, "publish": publish}, "c.yaml")


def test_publish_config_is_disabled_by_default_and_strict():
    cfg = config_from_dict({"data": {"format": "criteo_tsv", "raw_path": "x.txt"}}, "c.yaml")
    assert cfg.publish.enabled is False
    assert config_from_dict(cfg.to_dict(), "c.yaml").publish == cfg.publish  # a resolved config reloads
    ok = _cfg({"enabled": True, "every_n_steps": 5, "quantize": "int8"}).publish
    assert (ok.dir, ok.format, ok.every_partition) == (None, "safetensors", False)
    assert _cfg({"enabled": True, "every_partition": True}).publish.every_partition
    cases = [
        ({"dir": "pub"}, "publish.dir is set but publish.enabled is false"),
        ({"every_n_steps": 3}, "publish.every_n_steps is set but publish.enabled is false"),
        ({"enabled": True}, "exactly one of publish.every_n_steps"),
        ({"enabled": True, "every_n_steps": 2, "every_partition": True}, "exactly one of"),
        ({"enabled": True, "every_n_steps": 0}, "every_n_steps"),
        ({"enabled": True, "every_n_steps": 2, "format": "torchscript", "quantize": "int4"}, "TorchScript"),
        ({"enabled": True, "every_n_steps": 2, "quantize": "fp16"}, "quantize"),
        ({"enabled": True, "every_n_steps": 2, "when": 1}, "when"),
    ]
    for publish, message in cases:
        with pytest.raises(ConfigError, match=message):
            _cfg(publish)


def test_a_hand_edited_manifest_is_refused_naming_it(tmp_path):
    """An entry without its kind, one that is not an object, a latest given as text: named as
    damaged (were KeyError / TypeError tracebacks, or 'no version 3 (published: [1, 2, 3])')."""
    entry = {"version": 1, "kind": "full", "step": 2, "base": None, "dir": "v000001"}
    for versions, latest in [([{k: v for k, v in entry.items() if k != "kind"}], 1), ([entry, 5], 1), ([entry], "1")]:
        (tmp_path / "manifest.json").write_text(
            json.dumps({"format_version": 1, "latest": latest, "versions": versions})
        )
        with pytest.raises(CheckpointError, match="manifest.json: damaged or not a manifest of format_version 1"):
            load_published(tmp_path)


def test_two_runs_may_not_publish_into_one_directory_at_once(tmp_path):
    """A second publisher (another run) on a locked directory is refused, naming it; it would
    have moved the first one's versions aside and overwritten its manifest. The lock goes with
    its holder."""
    first = Publisher(tmp_path, FP32, resume_step=0, lock=True)
    with pytest.raises(CheckpointError, match="another process publishes into it now"):
        Publisher(tmp_path, FP32, resume_step=0, lock=True)
    del first
    Publisher(tmp_path, FP32, resume_step=0, lock=True)
