"""Which split (0 train, 1 validation, 2 test) each raw row goes to.

- ``position``: the first ``fractions[0]`` of the rows (file order) train, the next
  ``fractions[1]`` validation, the rest test. Needs the row count first (one quick pass).
- ``random``: row ``i`` (0-based, in file order) goes by ``u = splitmix64(seed, i) / 2**64``:
  train if ``u < fractions[0]``, validation if ``u < fractions[0] + fractions[1]``, else test.
  Reproducible for a seed and independent of block sizes and cores; the split sizes are
  binomial around the fractions (exact only in expectation).
- ``time``: by a numeric column (e.g. Avazu ``hour`` YYMMDDHH, a Unix timestamp): train if
  ``value < thresholds[0]``, validation if ``value < thresholds[1]``, else test.
- ``files``: ``raw_path`` is all train, ``validation_path`` all validation, ``test_path`` all
  test (e.g. Criteo 1TB days 0-22 / half of 23 / the other half).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SPLITS = ("train", "validation", "test")
BY = ("position", "random", "time", "files")


@dataclass(frozen=True)
class Split:
    """How rows are split; see the module docstring. ``fractions`` sum to 1 (position, random)."""

    by: str = "position"
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)
    seed: int = 0
    column: str | None = None
    thresholds: tuple[float, float] | None = None
    validation_path: str | None = None
    test_path: str | None = None

    def __post_init__(self) -> None:
        if self.by not in BY:
            raise ValueError(f"split.by must be one of {BY}, got {self.by!r}")
        if self.by == "time" and (not self.column or self.thresholds is None):
            raise ValueError("split.by 'time' needs split.column and split.thresholds [validation_start, test_start]")
        if self.by == "time" and self.thresholds[0] > self.thresholds[1]:
            raise ValueError(f"split.thresholds must be ascending, got {list(self.thresholds)}")
        if self.by == "files" and not (self.validation_path and self.test_path):
            raise ValueError("split.by 'files' needs split.validation_path and split.test_path")

    @staticmethod
    def of(split) -> Split:
        """A ``Split`` from a ``Split``, a config ``SplitConfig`` or three fractions."""
        if isinstance(split, Split):
            return split
        if isinstance(split, (tuple, list)):
            return Split(fractions=tuple(float(f) for f in split))
        return Split(
            by=split.by,
            fractions=tuple(split.fractions),
            seed=split.seed,
            column=split.column,
            thresholds=None if split.thresholds is None else tuple(split.thresholds),
            validation_path=split.validation_path,
            test_path=split.test_path,
        )

    def sources(self, raw_path: str | list[str]) -> list[tuple[str, int | None]]:
        """(raw file, the split all its rows go to, or None when rows are assigned one by one).
        ``raw_path``: one file, or (``files``) the training files."""
        paths = list(raw_path) if isinstance(raw_path, (list, tuple)) else [raw_path]
        if self.by == "files":
            return [(p, 0) for p in paths] + [(self.validation_path, 1), (self.test_path, 2)]
        return [(paths[0], None)]

    def fingerprint(self) -> list:
        """What changes the conversion (for the cache key)."""
        if self.by == "position":
            return list(self.fractions)
        if self.by == "random":
            return ["random", list(self.fractions), self.seed]
        if self.by == "time":
            return ["time", self.column, list(self.thresholds)]
        return ["files"] + [
            [str(Path(p).resolve()), os.stat(p).st_size, os.stat(p).st_mtime_ns]
            for p in (self.validation_path, self.test_path)
            if Path(p).is_file()
        ]

    def describe(self) -> dict:
        """The manifest's ``split`` entry (row bounds are added for position)."""
        d: dict = {"by": self.by}
        if self.by in ("position", "random"):
            d["fractions"] = list(self.fractions)
        if self.by == "position":
            d["order"] = "file order"
        if self.by == "random":
            d["seed"] = self.seed
            d["rule"] = "u = splitmix64(seed, row index) / 2**64: train if u < f0, validation if u < f0 + f1"
        if self.by == "time":
            d.update(
                column=self.column,
                thresholds=list(self.thresholds),
                rule="train if value < thresholds[0], validation if value < thresholds[1], else test",
            )
        if self.by == "files":
            d["files"] = {"validation": str(self.validation_path), "test": str(self.test_path)}
        return d


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def random_assign(seed: int, fractions: tuple, first_index: int, n: int) -> np.ndarray:
    """int8 [n] split of rows ``first_index .. first_index + n - 1`` (see module docstring)."""
    idx = np.arange(first_index, first_index + n, dtype=np.uint64)
    u = _splitmix64(idx ^ _splitmix64(np.array([seed], np.uint64))[0]).astype(np.float64) / 2.0**64
    return np.searchsorted(np.cumsum(fractions[:2]), u, side="right").astype(np.int8)


def time_assign(values: np.ndarray, thresholds: tuple) -> np.ndarray:
    """int8 [n]: 0 where value < thresholds[0], 1 where < thresholds[1], else 2."""
    return np.searchsorted(np.asarray(thresholds, np.float64), values, side="right").astype(np.int8)


def position_assign(bounds: np.ndarray, first_index: int, n: int) -> np.ndarray:
    """int8 [n] split of rows by position against ``bounds`` [0, train_end, validation_end, total]."""
    return (np.searchsorted(bounds[1:3], np.arange(first_index, first_index + n), side="right")).astype(np.int8)
