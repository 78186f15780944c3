"""A CSV table with a header row: one column is the target (strings give class names; numbers, with a
regression objective, values to regress on), the features are other columns. Cells are parsed strictly with the
csv module and float(): a missing, non-numeric or non-finite feature is an error naming its line and column."""

from __future__ import annotations

import csv as _csv
import io
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import _checks
from .._memory import available_memory
from ..errors import ConfigError, LeafpyError
from .parts import Parts

MAX_BYTES = 1 << 31
"""The largest CSV file read (it is read whole)."""
ROW_BYTES = 256
"""What a row of a table costs as CPython holds it, beyond its cells (a list and a tuple: about 220 bytes measured),
counted against the memory available before the table is parsed."""
CELL_BYTES = 64
"""What a cell costs as CPython holds it (a string and its place in its row: about 60 bytes measured)."""


def read_rows(path: str, delimiter: str = ",") -> tuple[list[str], list[list[str]], list[int]]:
    """The header, the rows of a CSV file (blank lines skipped) and the line each row starts on; a header that
    names a column twice, or a row with another number of cells than the header, is an error naming it."""
    if not isinstance(delimiter, str) or len(delimiter) != 1 or delimiter in "\r\n\"":
        raise ConfigError(f"data.delimiter: expected one character such as ',' or ';', got {delimiter!r}")
    try:
        with _checks.open_regular(path, "a CSV file") as raw:
            size = os.fstat(raw.fileno()).st_size
            if size > MAX_BYTES:
                raise LeafpyError(f"{path}: {size} bytes, more than the {MAX_BYTES} a CSV table may have; convert it "
                                  "to an .npz file")
            data = raw.read()
        _check_memory(path, data, delimiter)
        text = data.decode("utf-8-sig")
        del data
    except UnicodeDecodeError as e:
        raise LeafpyError(f"{path}: not UTF-8 text ({e}); save the table as UTF-8 CSV") from e
    except OSError as e:
        if isinstance(e, LeafpyError):
            raise
        raise LeafpyError(f"{path}: cannot read the CSV file: {e.strerror or e}") from e
    try:
        # the text as a file read with newline="": a quoted cell keeps its line breaks, and characters that
        # str.splitlines() would break at (form feed, U+2028...) stay in their cells
        reader = _csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, strict=True)
        rows, before = [], 0
        for r in reader:  # each row with the line it starts on (a quoted cell may run over lines)
            if r:
                rows.append((before + 1, r))
            before = reader.line_num
    except _csv.Error as e:
        raise LeafpyError(f"{path}: line {reader.line_num}: not valid CSV ({e})") from e
    if not rows:
        raise LeafpyError(f"{path}: empty; a CSV table needs a header row and one row per sample")
    header = [h.strip() for h in rows[0][1]]
    seen: dict[str, int] = {}
    for k, name in enumerate(header):
        if name and name in seen:  # (unnamed columns, a spreadsheet's trailing empty ones, are no feature by name)
            raise LeafpyError(f"{path}: line {rows[0][0]}: the header names column {name!r} twice (columns "
                              f"{seen[name] + 1} and {k + 1}); give each column a name of its own"[:500])
        seen[name] = k
    for line, r in rows[1:]:
        if len(r) != len(header):
            raise LeafpyError(f"{path}: line {line} has {len(r)} cells, the header {len(header)}; every row needs one "
                              f"cell per column (delimiter {delimiter!r})")
    if len(rows) < 2:
        raise LeafpyError(f"{path}: a header and no rows; give one row per sample")
    return header, [r for _, r in rows[1:]], [line for line, _ in rows[1:]]


def _check_memory(path: str, data: bytes, delimiter: str) -> None:
    """Refuse, before it is parsed, a table whose rows and cells (at most its lines and its lines plus delimiters)
    would take more memory than this process has available as Python objects (a row of two one-digit numbers takes
    over 100 times its 4 bytes)."""
    lines = data.count(b"\n") + 1
    cells = lines + data.count(delimiter.encode("utf-8"))
    need = 2 * len(data) + ROW_BYTES * lines + CELL_BYTES * cells
    have = available_memory()
    if have is not None and need > have:
        raise LeafpyError(f"{path}: {lines:,} lines of up to {cells:,} cells in all: reading it as a table needs about "
                          f"{_checks._bytes(need)}, more than the {_checks._bytes(have)} available; convert it to an "
                          ".npz file (np.savez(path, x=..., y=...)) and read it with data.dataset: npz, "
                          "memory_map: true")


def numbers(path: str, header: Sequence[str], rows: Sequence[Sequence[str]], columns: Sequence[str],
            lines: Sequence[int] | None = None) -> np.ndarray:
    """float32 [N, len(columns)] from those columns; a missing, non-numeric or non-finite cell is an error naming
    its line (``lines``: each row's, as read_rows gives them; else the row's place after the header) and column."""
    where = [column_index(path, header, c) for c in columns]
    out = np.empty((len(rows), len(where)), np.float32)
    for i, r in enumerate(rows):
        for j, k in enumerate(where):
            cell = r[k].strip()
            try:
                v = float(cell)
            except ValueError:
                v = math.nan
            if not math.isfinite(v) or abs(v) > 3.4e38:
                what = "is missing" if not cell else f"is {cell[:40]!r}, not a finite number"
                raise LeafpyError(f"{path}: line {_line(lines, i)}, column {header[k]!r}: the value {what}; fill it "
                                  "in or drop the row (or the column from data.features)")
            out[i, j] = v
    return out


def _line(lines: Sequence[int] | None, i: int) -> int:
    return lines[i] if lines is not None else i + 2


def column_index(path: str, header: Sequence[str], name: Any) -> int:
    if name == "":
        raise ConfigError(f"{path}: '' names no column (columns without a name in the header are not read); name "
                          "the column in the header row")
    if name not in header:
        raise ConfigError(f"{path}: no column {name!r}; the header has {', '.join(map(repr, header))}"[:500])
    return list(header).index(name)


def class_labels(path: str, header: Sequence[str], rows: Sequence[Sequence[str]], target: str,
                 lines: Sequence[int] | None = None) -> tuple[list[str], np.ndarray]:
    """The target column as class names (sorted: numerically when every name is an integer) and indices; a missing
    one is an error naming its line (``lines`` as in :func:`numbers`)."""
    k = column_index(path, header, target)
    cells = [r[k].strip() for r in rows]
    missing = next((i for i, c in enumerate(cells) if not c), None)
    if missing is not None:
        raise LeafpyError(f"{path}: line {_line(lines, missing)}, column {target!r}: the target is missing; fill it "
                          "in or drop the row")
    cells = [whole_number(c) for c in cells]  # "1.0" (an integer column written as floats) is class "1"
    names = sorted(set(cells), key=lambda c: (0, int(c), c) if _integer(c) else (1, 0, c))  # ("01" before "1")
    index = {n: i for i, n in enumerate(names)}
    return names, np.array([index[c] for c in cells], np.int64)


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
    header, rows, lines = read_rows(path, delimiter)
    quote = " (a column named like a number is written in quotes: '2020')"
    if not isinstance(target, str):
        hint = quote if isinstance(target, (int, float)) and not isinstance(target, bool) else ""
        raise ConfigError(f"data.target: expected the name of the label column, got {target!r}{hint}")
    column_index(path, header, target)
    if features is None:  # (columns without a name, as a spreadsheet's trailing empty one or pandas' index, are no
        features = [h for h in header if h and h != target]  # features)
    elif not isinstance(features, (list, tuple)) or not features or not all(isinstance(f, str) for f in features):
        numeric = isinstance(features, (list, tuple)) and any(
            isinstance(f, (int, float)) and not isinstance(f, bool) for f in features)
        raise ConfigError(f"data.features: expected a list of column names, got {features!r}"[:300]
                          + (quote if numeric else ""))
    if target in features:
        raise ConfigError(f"data.features: the target column {target!r} cannot be a feature too")
    if not features:
        raise ConfigError(f"{path}: no feature columns: the header names only the target column {target!r}; a table "
                          "needs a column of features besides the target")
    x = numbers(path, header, rows, features, lines)
    names: list[str] = []
    if targets == "values":
        y = numbers(path, header, rows, [target], lines)
    else:
        names, y = class_labels(path, header, rows, target, lines)
    return Parts(os.path.basename(path), x, y, len(names), None, tuple(names), (), tuple(features))
