"""One data file read and checked: its rows with their places (line, item, row) for messages, and
its digest; every format (JSON lines, a JSON array, CSV, parquet, text) reads into the same shape."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from .common import FORMATS, RecipeError


class FirstLabel(TypedDict, total=False):
    """The first label's type and place, carried across files by check_rows (empty before the first)."""

    kind: type
    at: str


@dataclass
class Rows:
    """One data file read and checked: its rows (only the fields the task uses), where each row is, its digest."""

    rows: list[dict[str, Any]]
    where: list[str]  # "line 7" / "item 3": for messages
    source: str
    sha256: str


def _utf8(raw: bytes, source: str) -> str:
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise RecipeError(
            f"{source}, line {line}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {column}); "
            "save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def read_rows(path: Path) -> Rows:
    """Rows of a local file with their positions, and the file's sha256. JSON lines, a JSON array,
    CSV (header row), parquet, or text (one row per non-empty line, field 'text').

    Raises:
        RecipeError: not UTF-8, not valid JSON/CSV, a row that is not an object, an empty file;
            the message names the file and the line.
    """
    source = str(path)
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    kind = FORMATS[path.suffix]
    if kind == "parquet":
        rows, where = _parquet_rows(raw, source)
    elif kind == "text":
        rows, where = _text_rows(_utf8(raw, source))
    elif kind == "csv":
        rows, where = _csv_rows(_utf8(raw, source), source)
    else:
        rows, where = _json_rows(_utf8(raw, source), source)
    for row, at in zip(rows, where):
        if not isinstance(row, dict):
            raise RecipeError(
                f"{source}, {at}: a JSON {type(row).__name__} where a row object belongs; "
                'each row must be an object such as {"text": "..."}'
            )
    if not rows:
        raise RecipeError(f"{source}: has no rows; give a file with at least 2 rows (one is carved off for validation)")
    return Rows(rows=rows, where=where, source=source, sha256=digest)


def _parquet_rows(raw: bytes, source: str) -> tuple[list[Any], list[str]]:
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(io.BytesIO(raw)).to_pylist()
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid family for broken files
        raise RecipeError(
            f"{source}: not a readable parquet file ({type(e).__name__}: {str(e)[:160]}); rewrite it"
        ) from None
    return rows, [f"row {i + 1}" for i in range(len(rows))]


def _text_rows(text: str) -> tuple[list[dict[str, str]], list[str]]:
    rows: list[dict[str, str]] = []
    where: list[str] = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            rows.append({"text": line})
            where.append(f"line {n}")
    return rows, where


def _csv_rows(text: str, source: str) -> tuple[list[dict[str, str]], list[str]]:
    import csv

    rows: list[dict[str, str]] = []
    where: list[str] = []
    reader = csv.DictReader(io.StringIO(text, newline=""))
    try:
        for row in reader:
            if None in row:
                raise RecipeError(
                    f"{source}, line {reader.line_num}: more values than the header's "
                    f"{len(reader.fieldnames or [])} columns; quote values that contain commas"
                )
            rows.append(row)
            where.append(f"line {reader.line_num}")
    except csv.Error as e:
        raise RecipeError(f"{source}, line {reader.line_num}: not valid CSV ({e}); fix the line") from None
    return rows, where


def _json_rows(text: str, source: str) -> tuple[list[Any], list[str]]:
    """A JSON array (one item a row) or JSON lines (one line a row)."""
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecipeError(
                f"{source}, line {e.lineno}: not valid JSON ({e.msg} at column {e.colno}); fix the file"
            ) from None
        except RecursionError:
            raise RecipeError(
                f"{source}: nested too deeply to read (thousands of [ or {{ levels); fix the file"
            ) from None
        return rows, [f"item {i + 1}" for i in range(len(rows))]
    rows = []
    where: list[str] = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RecipeError(
                f"{source}, line {n}: not valid JSON ({e.msg} at column {e.colno}); "
                'each line must be one JSON object such as {"text": "...", "label": 0}'
            ) from None
        except RecursionError:
            raise RecipeError(
                f"{source}, line {n}: nested too deeply to read (thousands of [ or {{ levels); fix the line"
            ) from None
        where.append(f"line {n}")
    return rows, where


def check_rows(data: Rows, fields: list[str], *, label_field: str | None, first_label: FirstLabel) -> list[str]:
    """Every row has every field as non-empty text, and the label as an int or a string, one type
    for all (``first_label`` carries the first label's type and place across files)."""
    problems = []
    for row, at in zip(data.rows, data.where):
        for name in fields:
            value = row.get(name)
            if name == label_field:
                if value is None or isinstance(value, float) or not isinstance(value, (int, str)):
                    problems.append(
                        f"{data.source}, {at}: field {name!r} is {'missing' if name not in row else repr(value)}; "
                        "every row needs a label, an integer or a string"
                    )
                    continue
                kind = type(value)
                if not first_label:
                    first_label.update({"kind": kind, "at": f"{data.source}, {at}"})
                elif kind is not first_label["kind"]:
                    problems.append(
                        f"{data.source}, {at}: field {name!r} is {value!r} ({kind.__name__}) but the label at "
                        f"{first_label['at']} is a {first_label['kind'].__name__}; use one type for every label "
                        "(all integers or all strings)"
                    )
            elif not isinstance(value, str) or not value.strip():
                problems.append(
                    f"{data.source}, {at}: field {name!r} is {'missing' if name not in row else repr(value)}; "
                    f"every row needs non-empty text in {name!r} (the row's fields: {sorted(row)})"
                )
        if len(problems) >= 5:
            problems.append("(stopped after 5 problems)")
            break
    return problems
