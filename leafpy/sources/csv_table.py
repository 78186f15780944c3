"""A CSV table with a header row: one column is the target (strings give class names; numbers, with a
regression objective, values to regress on), the features are other columns. Cells are parsed strictly with the
csv module and float(): a missing, non-numeric or non-finite feature is an error naming its line and column.

The table is read in one streaming pass, a block of rows at a time, straight into float32 arrays: what it holds in
memory is its numbers (4 bytes a cell), not its text, so a table of any length whose numbers fit in memory reads."""

from __future__ import annotations

import csv as _csv
import io
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import _checks
from .._memory import available_memory
from ..errors import ConfigError, LeafpyError
from .parts import Parts

BLOCK_ROWS = 1 << 14
"""Rows parsed into one block of the arrays before the next is started (the blocks are joined at the end); fewer
for a wide table, so that a block holds at most BLOCK_VALUES values."""
BLOCK_VALUES = 1 << 22
CLASS_BYTES = 200
"""What a distinct class name costs as it is kept while the table is read (a string and its place in a dict)."""


class Table(NamedTuple):
    """What :func:`scan` read: the header, the features [N, F] (float32), the target (int64 class indices, float32
    [N, 1] values, or None where none was asked for), the class names (sorted), the line each row starts on and the
    features' column names, in the order of x's columns."""
    header: list[str]
    x: np.ndarray
    y: np.ndarray | None
    class_names: list[str]
    lines: np.ndarray
    features: list[str]


def _check_delimiter(delimiter: Any) -> None:
    if not isinstance(delimiter, str) or len(delimiter) != 1 or delimiter in "\r\n\"":
        raise ConfigError(f"data.delimiter: expected one character such as ',' or ';', got {delimiter!r}")


def _rows(path: str, raw: Any, delimiter: str) -> Iterator[tuple[int, list[str]]]:
    """Each non-blank row of the file with the line it starts on (a quoted cell may run over lines and keeps its
    line breaks, as do characters that str.splitlines() would break at: the text is read with newline="")."""
    reader = _csv.reader(io.TextIOWrapper(raw, encoding="utf-8-sig", newline=""), delimiter=delimiter, strict=True)
    before = 0
    try:
        for r in reader:
            if r:
                yield before + 1, r
            before = reader.line_num
    except UnicodeDecodeError as e:
        raise LeafpyError(f"{path}: not UTF-8 text after line {reader.line_num} ({e}); save the table as UTF-8 "
                          "CSV") from e
    except _csv.Error as e:
        raise LeafpyError(f"{path}: line {reader.line_num}: not valid CSV ({e})") from e


def _check_header(path: str, line: int, header: list[str]) -> None:
    seen: dict[str, int] = {}
    for k, name in enumerate(header):
        if name and name in seen:  # (unnamed columns, a spreadsheet's trailing empty ones, are no feature by name)
            raise LeafpyError(f"{path}: line {line}: the header names column {name!r} twice (columns "
                              f"{seen[name] + 1} and {k + 1}); give each column a name of its own"[:500])
        seen[name] = k


def scan(path: str, delimiter: str, features: Sequence[str] | None, target: str | None = None,
         targets: str = "classes") -> Table:
    """Read the table: ``features`` (None: every named column but the target) as numbers and ``target`` (None:
    no target) as class names (``targets`` "classes") or numbers ("values"). A header that names a column twice,
    a row with another number of cells than the header, a missing or non-numeric feature, a missing target, a
    table with no rows, or one whose arrays would not fit in the memory available is an error naming it."""
    _check_delimiter(delimiter)
    path = os.fspath(path)
    have = available_memory()
    try:
        with _checks.open_regular(path, "a CSV file") as raw:
            rows = _rows(path, raw, delimiter)
            first = next(rows, None)
            if first is None:
                raise LeafpyError(f"{path}: empty; a CSV table needs a header row and one row per sample")
            header_line, cells = first
            header = [h.strip() for h in cells]
            _check_header(path, header_line, header)
            where, t = _columns(path, header, features, target, delimiter)
            return _read(path, rows, header, where, t, targets, delimiter, have)
    except OSError as e:
        if isinstance(e, LeafpyError):
            raise
        raise LeafpyError(f"{path}: cannot read the CSV file: {e.strerror or e}") from e


def _columns(path: str, header: list[str], features: Sequence[str] | None, target: str | None, delimiter: str
             ) -> tuple[list[int], int | None]:
    places = _places(header)
    t = None if target is None else column_index(path, header, target, delimiter, places)
    if features is None:  # (columns without a name, as a spreadsheet's trailing empty one or pandas' index, are no
        features = [h for h in header if h and h != target]  # features)
        if not features:
            raise ConfigError(f"{path}: no feature columns: the header names only the target column {target!r}; a "
                              "table needs a column of features besides the target")
    return [column_index(path, header, c, delimiter, places) for c in features], t


def _read(path: str, rows: Iterator[tuple[int, list[str]]], header: list[str], where: list[int], t: int | None,
          targets: str, delimiter: str, have: int | None) -> Table:
    width = len(header)
    row_bytes = 4 * len(where) + 8 + (0 if t is None else 8)  # a row's numbers, its line, its target
    blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    codes: dict[str, int] = {}  # class name -> its index in order of first appearance
    n = 0
    block = max(1, min(BLOCK_ROWS, BLOCK_VALUES // max(len(where), 1)))
    x = np.empty((block, len(where)), np.float32)
    y = np.empty(block, np.float32 if targets == "values" else np.int64)
    lines = np.empty(block, np.int64)
    i = 0
    for line, r in rows:
        if len(r) != width:
            raise LeafpyError(f"{path}: line {line} has {len(r)} cells, the header {width}; every row needs one "
                              f"cell per column (delimiter {delimiter!r})")
        lines[i] = line
        for j, k in enumerate(where):
            x[i, j] = _number(path, header, line, k, r[k])
        if t is not None:
            if targets == "values":
                y[i] = _number(path, header, line, t, r[t])
            else:
                y[i] = codes.setdefault(_class_name(path, header, line, t, r[t]), len(codes))
        i += 1
        if i == block:
            n += i
            # the blocks and their joined copy (twice the arrays, at the end) within what was available
            if have is not None and 2 * n * row_bytes + CLASS_BYTES * len(codes) > have:
                _too_big(path, n, row_bytes, have)
            blocks.append((x, y, lines))
            x, y, lines = np.empty_like(x), np.empty_like(y), np.empty_like(lines)
            i = 0
    n += i
    blocks.append((x[:i], y[:i], lines[:i]))
    if n == 0:
        raise LeafpyError(f"{path}: a header and no rows; give one row per sample")
    xs = np.concatenate([b[0] for b in blocks]) if len(blocks) > 1 else blocks[0][0].copy()
    ys = np.concatenate([b[1] for b in blocks]) if len(blocks) > 1 else blocks[0][1].copy()
    at = np.concatenate([b[2] for b in blocks]) if len(blocks) > 1 else blocks[0][2].copy()
    names: list[str] = []
    out_y: np.ndarray | None = None
    if t is not None and targets == "values":
        out_y = ys.reshape(-1, 1)
    elif t is not None:
        names = sorted(codes, key=lambda c: (0, int(c), c) if _integer(c) else (1, 0, c))  # ("01" before "1")
        order = np.empty(len(codes), np.int64)
        order[[codes[c] for c in names]] = np.arange(len(names))
        out_y = order[ys]
    return Table(header, xs, out_y, names, at, [header[k] for k in where])


def _too_big(path: str, rows: int, row_bytes: int, have: int) -> None:
    raise LeafpyError(f"{path}: its first {rows:,} rows already take {_checks._bytes(rows * row_bytes)} as numbers "
                      f"(twice that while they are joined), more than the {_checks._bytes(have)} of memory "
                      "available; convert it to an .npz file (np.savez(path, x=..., y=...)) and read it with "
                      "data.dataset: npz, memory_map: true")


def _number(path: str, header: Sequence[str], line: int, k: int, text: str) -> float:
    cell = text.strip()
    try:
        v = float(cell)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or abs(v) > 3.4e38:
        what = "is missing" if not cell else f"is {cell[:40]!r}, not a finite number"
        raise LeafpyError(f"{path}: line {line}, column {header[k]!r}: the value {what}; fill it in or drop the row "
                          "(or the column from data.features)")
    return v


def _class_name(path: str, header: Sequence[str], line: int, k: int, text: str) -> str:
    cell = text.strip()
    if not cell:
        raise LeafpyError(f"{path}: line {line}, column {header[k]!r}: the target is missing; fill it in or drop the "
                          "row")
    return whole_number(cell)  # "1.0" (an integer column written as floats) is class "1"


def column_index(path: str, header: Sequence[str], name: Any, delimiter: str,
                 places: dict[str, int] | None = None) -> int:
    """Where ``name`` is in ``header``, read with ``delimiter`` (data.delimiter); a name not there is refused,
    naming the header (and, for a header of one cell holding another common delimiter, the one it was read with).
    ``places``: each name's first column (:func:`_places`), for a wide header looked up many times."""
    if name == "":
        raise ConfigError(f"{path}: '' names no column (columns without a name in the header are not read); name "
                          "the column in the header row")
    at = (places if places is not None else _places(header)).get(name)
    if at is None:
        raise ConfigError(f"{path}: no column {name!r}; the header has {', '.join(map(repr, header[:50]))}"[:500]
                          + _delimiter_hint(header, delimiter))
    return at


def _places(header: Sequence[str]) -> dict[str, int]:
    places: dict[str, int] = {}
    for k, name in enumerate(header):
        places.setdefault(name, k)
    return places


DELIMITERS = (",", ";", "\t", "|")
"""The delimiters a header of one cell is looked at for (one of them in it: the table's delimiter is another)."""


def _delimiter_hint(header: Sequence[str], delimiter: str) -> str:
    """A hint for a header read as one cell that holds another common delimiter than ``delimiter``, else ""."""
    found = [d for d in DELIMITERS if d != delimiter and len(header) == 1 and d in header[0]]
    if not found:
        return ""
    return (f" (one cell: the table's cells seem to be split by {found[0]!r}, but it is read with data.delimiter "
            f"{delimiter!r}; write the table with {delimiter!r} between cells, or set data.delimiter to "
            f"{found[0]!r})")


def whole_number(cell: str) -> str:
    """An integer written with a decimal point and zeros ("2.0", "-3.00") as the integer ("2", "-3"); any other
    cell as it is."""
    head, dot, tail = cell.partition(".")
    digits = head[1:] if head[:1] == "-" else head
    if dot and digits.isascii() and digits.isdecimal() and (not tail or set(tail) == {"0"}):
        return str(int(head))
    return cell


def _integer(cell: str) -> bool:
    try:
        int(cell)
    except ValueError:
        return False
    return True


def read(path: str, target: str, *, features: Sequence[str] | None = None, delimiter: str = ",",
         targets: str = "classes") -> Parts:
    """A CSV table (see ``lp.data.csv``) as :class:`Parts`."""
    path = os.fspath(path)
    quote = " (a column named like a number is written in quotes: '2020')"
    if not isinstance(target, str):
        hint = quote if isinstance(target, (int, float)) and not isinstance(target, bool) else ""
        raise ConfigError(f"data.target: expected the name of the label column, got {target!r}{hint}")
    if features is not None:
        if not isinstance(features, (list, tuple)) or not features or not all(isinstance(f, str) for f in features):
            numeric = isinstance(features, (list, tuple)) and any(
                isinstance(f, (int, float)) and not isinstance(f, bool) for f in features)
            raise ConfigError(f"data.features: expected a list of column names, got {features!r}"[:300]
                              + (quote if numeric else ""))
        if target in features:
            raise ConfigError(f"data.features: the target column {target!r} cannot be a feature too")
    table = scan(path, delimiter, features, target, targets)
    assert table.y is not None  # (a target was asked for)
    return Parts(os.path.basename(path), table.x, table.y, len(table.class_names), None, tuple(table.class_names),
                 (), tuple(table.features))
