"""A rank's random state in a checkpoint (recsys_dist.checkpoint.rng): the CPU generator's, and
on CUDA the device generator's, which dropout on CUDA tensors draws from."""

import pytest
import torch

from recsys_dist.checkpoint.rng import fit_rng, restore_rng, rng_state

CUDA = torch.device("cuda", 0)


def test_the_cpu_state_is_saved_and_restored():
    state = {"rng": rng_state(0, torch.device("cpu"))}
    assert list(state["rng"]) == ["rank_0"]
    want = torch.rand(4)
    torch.rand(7)  # the stream moves on
    restore_rng(state, 0, torch.device("cpu"))
    assert torch.equal(torch.rand(4), want)
    restore_rng({}, 0, torch.device("cpu"))  # another world size: nothing to restore


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's generator state calls on a CPU-only machine: a dict per device."""
    states: dict = {CUDA: torch.tensor([1, 2, 3], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: states[device].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: states.__setitem__(device, state.clone()))
    return states


def test_on_cuda_the_device_generator_travels_too(fake_cuda):
    state = {"rng": rng_state(1, CUDA)}
    assert sorted(state["rng"]) == ["rank_1", "rank_1_cuda"]
    assert state["rng"]["rank_1_cuda"].tolist() == [1, 2, 3]
    fake_cuda[CUDA] = torch.tensor([9], dtype=torch.uint8)  # the device's stream moved on
    restore_rng(state, 1, CUDA)
    assert fake_cuda[CUDA].tolist() == [1, 2, 3]


def test_a_checkpoint_without_the_device_entry_restores_the_cpu_one(fake_cuda):
    state = {"rng": rng_state(0, CUDA)}
    fit_rng(state, ["model.w", "rng.rank_0"])  # written on CPU
    assert list(state["rng"]) == ["rank_0"]
    fake_cuda[CUDA] = torch.tensor([9], dtype=torch.uint8)
    restore_rng(state, 0, CUDA)
    assert fake_cuda[CUDA].tolist() == [9]  # left as seeded
    kept = {"rng": rng_state(0, CUDA)}
    fit_rng(kept, ["rng.rank_0", "rng.rank_0_cuda"])
    assert sorted(kept["rng"]) == ["rank_0", "rank_0_cuda"]


@pytest.mark.gpu
def test_a_cuda_generator_resumes_its_stream():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    state = {"rng": rng_state(0, CUDA)}
    want = torch.rand(5, device=CUDA)
    torch.rand(11, device=CUDA)
    restore_rng(state, 0, CUDA)
    assert torch.equal(torch.rand(5, device=CUDA), want)


def test_the_trainers_checkpoint_holds_the_device_generator(fake_cuda):
    from recsys_dist.train.checkpointing import training_state

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    assert sorted(training_state(model, optimizer, 0, CUDA)["rng"]) == ["rank_0", "rank_0_cuda"]
