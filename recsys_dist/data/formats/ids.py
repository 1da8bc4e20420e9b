"""Which raw columns hold ids keyed by their text, and which of them held only integers in a
training file.

An id is keyed by its text (BLAKE2b of the UTF-8 bytes, ``recsys_dist.data.mapping.text_keys``),
so ``100370`` and ``100370.0`` are two ids. A scoring request sends values as JSON, where an id
may arrive as a number; ``recsys_dist.serve.request_rows`` maps a JSON integer to its decimal text, and
a JSON float only for a column whose training values were all integers written that way
(:class:`IdText` finds them while the training file is converted; the manifest and the
preprocessing record keep them as ``integer_columns``, beside the file's ``raw_columns``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from recsys_dist.data.text import LINE_COLUMN

# The text ``str(n)`` gives for a Python int: no sign on zero, no leading zero, no spaces.
INTEGER_TEXT = r"^(0|-?[1-9][0-9]*)$"
AVAZU_ID_COLUMNS = (
    "C1 banner_pos site_id site_domain site_category app_id app_domain app_category device_id device_ip "
    "device_model device_type device_conn_type C14 C15 C16 C17 C18 C19 C20 C21"
).split()


@dataclass(frozen=True)
class IdColumn:
    """A raw column keyed by its text: ``separator`` splits a multi-hot or sequence text value
    into elements (None: one value per row); ``trimmed``: spaces around a value (element) are
    dropped before it is keyed."""

    name: str
    separator: str | None = None
    trimmed: bool = False


def id_columns(format_name: str, spec) -> list[IdColumn]:
    """The raw columns of a format whose values are ids keyed by their text: a schema's
    categorical, multi-hot and sequence columns and its history's user and item columns (hex
    columns left out: read as hex numbers, never as decimal text), avazu's categorical columns.
    Criteo's C1..C26 are hex: none. ``spec``: the ``data.schema`` section (schema only)."""
    if format_name == "avazu_csv":
        return [IdColumn(c) for c in AVAZU_ID_COLUMNS]
    if not format_name.startswith("schema") or spec is None:
        return []
    hexed = set(spec.hex_categorical or [])
    out = [IdColumn(c) for c in spec.categorical if c not in hexed]
    out += [IdColumn(c, spec.separator, True) for c in spec.multi_hot if c not in hexed]
    out += [IdColumn(c, q.separator, True) for c, q in (spec.sequence or {}).items()]
    if spec.history is not None:
        out += [IdColumn(c, None, True) for c in (spec.history.user, spec.history.item)]
    seen: set[str] = set()
    return [c for c in out if not (c.name in seen or seen.add(c.name))]


def _elements(col: pa.Array, c: IdColumn) -> pa.Array:
    """The non-empty values (elements) of a column, as the conversion keys them."""
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        col = pc.list_flatten(col)
    elif c.separator is not None:
        col = pc.list_flatten(pc.split_pattern(pc.fill_null(col, ""), c.separator))
    text = pc.fill_null(col, "")
    if c.trimmed:
        text = pc.utf8_trim_whitespace(text)
    return text.filter(pc.not_equal(text, ""))


class IdText:
    """What a conversion learns of its raw file's columns, batch by batch (``add``; ``merge``
    another's): ``raw_columns``, the columns read, in order; ``integer_columns()``, the id
    columns whose every non-empty value (element) was an integer's decimal text."""

    def __init__(self, columns: list[IdColumn]) -> None:
        self.columns = columns
        self.raw_columns: list[str] = []
        self.present: set[str] = set()  # columns with at least one value
        self.other: set[str] = set()  # columns with a value that is not an integer's text

    def add(self, batch: pa.RecordBatch) -> None:
        names = [n for n in batch.schema.names if n != LINE_COLUMN]
        self.raw_columns += [n for n in names if n not in self.raw_columns]
        for c in self.columns:
            if c.name in self.other or c.name not in names:
                continue  # decided already: no need to look at more values
            values = _elements(batch.column(c.name), c)
            if len(values) == 0:
                continue
            self.present.add(c.name)
            if not pc.all(pc.match_substring_regex(values, INTEGER_TEXT)).as_py():
                self.other.add(c.name)

    def merge(self, other: IdText) -> None:
        self.raw_columns += [n for n in other.raw_columns if n not in self.raw_columns]
        self.present |= other.present
        self.other |= other.other

    def integer_columns(self) -> list[str]:
        return [c.name for c in self.columns if c.name in self.present and c.name not in self.other]
