"""``data.split``: how rows are split into train / validation / test (the rules:
``recsys_dist.data.splits``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from recsys_dist.section import Section as _Section
from recsys_dist.section import StrictFloat as _F


class SplitConfig(_Section):
    """How rows are split into train / validation / test (``recsys_dist.data.splits``)."""

    by: Literal["position", "random", "time", "files", "leave_last_out"] = Field(
        "position",
        description="position: fractions of rows in file order; random: each row by a seeded hash "
        "of its index; time: by split.column against split.thresholds; files: raw_path is train, "
        "split.validation_path and split.test_path the other splits; leave_last_out: per split.user, by "
        "split.column (time, ties in file order), the last row is test, the one before it validation, the "
        "rest train (users with fewer than 3 rows: all train); any row order, one extra pass over the two "
        "columns, memory about 450 bytes per user (docs/data.md, 'Splits').",
    )
    fractions: tuple[_F, _F, _F] = Field(
        (0.8, 0.1, 0.1), strict=False, description="position / random: train, validation, test fractions (sum 1)."
    )
    seed: int = Field(0, ge=0, description="random: seed of the row assignment.")
    column: str | None = Field(
        None, description="time, leave_last_out: numeric raw time column, e.g. Avazu hour (YYMMDDHH), a timestamp."
    )
    user: str | None = Field(None, description="leave_last_out: the raw user column (rows of one value are one user).")
    thresholds: tuple[_F, _F] | None = Field(
        None,
        strict=False,
        description="time: [validation_start, test_start]: value < first is train, < second validation, the rest test.",
    )
    validation_path: str | None = Field(None, description="files: raw validation file (relative to the config file).")
    test_path: str | None = Field(None, description="files: raw test file (relative to the config file).")

    @model_validator(mode="after")
    def _check(self) -> SplitConfig:
        f = self.fractions
        if any(x < 0 for x in f) or abs(sum(f) - 1.0) > 1e-6:
            raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {list(f)}")
        if f[0] <= 0:
            raise ValueError("the train fraction (fractions[0]) must be > 0")
        if self.by == "time":
            if not self.column or self.thresholds is None:
                raise ValueError("by time needs column and thresholds [validation_start, test_start]")
            if self.thresholds[0] > self.thresholds[1]:
                raise ValueError(f"thresholds must be ascending, got {list(self.thresholds)}")
        if self.by == "files" and not (self.validation_path and self.test_path):
            raise ValueError("by files needs validation_path and test_path")
        if self.by == "leave_last_out" and not (self.user and self.column):
            raise ValueError("by leave_last_out needs user (the user column) and column (the time column)")
        # fractions and seed have defaults, which a saved config (config.yaml) lists: only other values count
        for key, bys in (("fractions", ("position", "random")), ("seed", ("random",))):
            if self.by not in bys and getattr(self, key) != type(self).model_fields[key].default:
                raise ValueError(
                    f"{key} only applies to by: {' / '.join(bys)}, not by: {self.by} (it would be ignored); remove it"
                )
        for key, bys in (
            ("column", ("time", "leave_last_out")),
            ("thresholds", ("time",)),
            ("user", ("leave_last_out",)),
            ("validation_path", ("files",)),
            ("test_path", ("files",)),
        ):
            if self.by not in bys and getattr(self, key) is not None:
                raise ValueError(f"{key} only applies to by: {' / '.join(bys)}, not by: {self.by}")
        return self


def check_last_out(split: SplitConfig, history) -> None:
    """``leave_last_out`` with a derived history (``data.schema.history``, or None): one user and
    time column, one order of ties.

    Raises:
        ValueError: naming the ``data.split`` / ``data.schema.history`` key and the fix."""
    if split.by != "leave_last_out" or history is None:
        return
    for key, mine, theirs in (("user", split.user, history.user), ("column", split.column, history.time)):
        if mine != theirs:
            raise ValueError(
                f"data.split.{key}: {mine!r} is not data.schema.history's {'user' if key == 'user' else 'time'} "
                f"column {theirs!r}: leave_last_out's targets and the histories must order one user's rows alike"
            )
    if history.ties != "file_order":
        raise ValueError(
            "data.schema.history.ties: exclude makes rows of equal time invisible to each other, but "
            "data.split.by: leave_last_out orders them by file order (the test row is the later one), so a "
            "test row would not read a validation row of its own time; set data.schema.history.ties: file_order"
        )
