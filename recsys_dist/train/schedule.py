"""Learning-rate schedule of the MLPerf DLRMv2 reference (``LRPolicyScheduler``).

``scale(step)``: linear warmup ``step / warmup_steps`` for ``step < warmup_steps``; from
``decay_start_step`` a polynomial (squared) decay ``((D - (step - start)) / D) ** 2`` over
``D = decay_steps`` steps, floored at ``min_lr``; after that the last rate holds. The rate
of every optimizer group (dense, data-parallel tables and the fused FBGEMM tables) is
``base_lr * scale(step)``. It depends on the step only, so a resumed run continues it exactly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    warmup_steps: int = 0
    decay_start_step: int | None = None
    decay_steps: int = 0
    min_lr: float = 1e-7

    def scale(self, step: int) -> float:
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay_start_step is not None and self.decay_steps and step >= self.decay_start_step:
            done = min(step - self.decay_start_step, self.decay_steps)
            return ((self.decay_steps - done) / self.decay_steps) ** 2
        return 1.0

    @property
    def active(self) -> bool:
        return bool(self.warmup_steps) or (self.decay_start_step is not None and bool(self.decay_steps))

    def apply(self, optimizer, base_lrs: list[float], step: int) -> None:
        """Set every param group's lr for global step ``step`` (0-based, before that step)."""
        s = self.scale(step)
        for group, base in zip(optimizer.param_groups, base_lrs):
            group["lr"] = max(base * s, self.min_lr) if s < 1.0 else base
