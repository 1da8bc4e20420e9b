"""A rank's random state in a checkpoint: the CPU generator's, and on a CUDA device that
device's generator's too (dropout on CUDA tensors draws from the device's generator, so a
resume that restored only the CPU one would draw other masks than the uninterrupted run,
with exit code 0).

The checkpoint entry is ``rng``: ``{"rank_R": cpu state, "rank_R_cuda": device state}`` (uint8
tensors, one entry per rank: ranks draw different masks). A checkpoint written on CPU has no
``rank_R_cuda``; resumed on CUDA it restores the CPU state only (the device's generator stays
as seeded), and a CUDA checkpoint resumed on CPU leaves its device entry unread.
"""

from __future__ import annotations

import torch


def _cuda_key(rank: int) -> str:
    return f"rank_{rank}_cuda"


def rng_state(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's random state as the checkpoint's ``rng`` entry holds it (views are not
    needed: loading replaces the tensors in this dict, then :func:`restore_rng` applies them)."""
    state = {f"rank_{rank}": torch.get_rng_state()}
    if device.type == "cuda":
        state[_cuda_key(rank)] = torch.cuda.get_rng_state(device)
    return state


def fit_rng(state: dict, saved_keys) -> None:
    """Leave out of ``state["rng"]`` the device entry a checkpoint (its flat keys
    ``saved_keys``) does not hold: one written on CPU, resumed on CUDA."""
    rng = state.get("rng")
    if rng is None:
        return
    saved = set(saved_keys)
    for key in [k for k in rng if k.endswith("_cuda")]:
        if f"rng.{key}" not in saved:
            del rng[key]


def restore_rng(state: dict, rank: int, device: torch.device) -> None:
    """Set this rank's generators from the loaded ``state["rng"]`` (nothing without it: the
    world size changed, so no rank's random stream continues)."""
    rng = state.get("rng")
    if rng is None:
        return
    torch.set_rng_state(rng[f"rank_{rank}"])
    if device.type == "cuda" and _cuda_key(rank) in rng:
        torch.cuda.set_rng_state(rng[_cuda_key(rank)], device)
