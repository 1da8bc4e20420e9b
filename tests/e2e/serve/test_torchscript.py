"""The TorchScript artefact: plain tensors in, the model's logits out, loadable with torch alone."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.e2e.serve.conftest import cli, converted_test_split, logits
from tests.unit.serve.test_torchscript import CONFIGS, FOREIGN, _docs_example, build

# Run in a fresh process: load each artefact with torch alone and score the saved inputs.
LOADER = f"""
import sys, torch
for path in sys.argv[1:]:
    model = torch.jit.load(path + ".pt")
    inputs, want = torch.load(path + ".in")
    with torch.no_grad():
        got = model(*inputs)
    print(path, float((got - want).abs().max()))
bad = sorted(m for m in sys.modules if m.split(".")[0] in {FOREIGN!r})
print("foreign modules:", bad)
"""


def test_every_shipped_model_exports_and_loads_with_torch_alone(tmp_path):
    from recsys_dist.serve.torchscript import example_inputs, reference_logits, to_torchscript

    paths = []
    for name in [*CONFIGS, "deepfm-bf16"]:
        job, task = build(name.split("-")[0], *(["train.precision=bf16-mixed"] if "bf16" in name else []))
        artefact = to_torchscript(job, task)
        dense, values, lengths = example_inputs(job.features.num_dense, job.table_sizes, 64, 9, True)
        with torch.no_grad():
            want = reference_logits(task, dense, values, lengths, job.features.keys)
            assert torch.equal(artefact(dense, values, lengths), want), name
        artefact.save(str(tmp_path / f"{name}.pt"))
        torch.save(((dense, values, lengths), want), tmp_path / f"{name}.in")
        paths.append(str(tmp_path / name))
    r = subprocess.run([sys.executable, "-c", LOADER, *paths], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "foreign modules: []"
    assert [float(x.split()[-1]) for x in lines[:-1]] == [0.0] * len(paths)


@pytest.mark.slow
@pytest.mark.parametrize("run_fixture, prefix", [("movielens_run", "schema"), ("criteo_run", "criteo")])
def test_docs_example_matches_predict(run_fixture, prefix, tmp_path, request):
    """docs/serving.md's example, in a fresh process without recsys_dist or torchrec, gives
    `recsys-dist predict`'s logits on the converted test split (DeepFM with a multi-hot mean
    bag and a vocabulary; DLRM with dense features)."""
    tmp, run = request.getfixturevalue(run_fixture)[:2]
    export = tmp_path / "export"
    r = cli(["export", run, "--out", export, "--format", "torchscript"], tmp)
    assert "model.torchscript.pt, serving.json" in r.stdout
    test = converted_test_split(tmp, prefix)
    cli(["predict", export, "--data", test, "--out", tmp_path / "p.parquet"], tmp)
    want = logits(tmp_path / "p.parquet")
    r = subprocess.run(
        [sys.executable, str(_docs_example(tmp_path)), str(export), str(test)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.array(json.loads(r.stdout.strip().splitlines()[-1]), np.float32)
    assert len(got) == len(want) > 100
    assert np.abs(got - want).max() <= 1e-6
    spec = json.loads((export / "serving.json").read_text())
    assert spec["written_by"]["torch"] and [f["name"] for f in spec["sparse"]][:2] in (
        ["userId", "movieId"],
        ["C1", "C2"],
    )
