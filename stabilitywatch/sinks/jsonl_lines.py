"""JSON lines for stats records, from plain Python values only (no package imports): the JSONL
sink's writer process (jsonl_writer.py) imports this file alone, without torch.

A frame's records share one table of columns (name -> list of values, one per row); they are
encoded column by column: one `float.__repr__` per value and one %-format per line, in C.
"""
from __future__ import annotations

import json
from array import array
import math
from typing import Any


def dumps(obj: Any) -> str:
    # allow_nan=False: a stray non-finite float must fail loudly, never produce invalid JSON.
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))


def json_float(v: float):
    """JSON has no NaN/Inf: keep finite floats, write the others as strings (as alert.py)."""
    v = float(v)
    return v if math.isfinite(v) else str(v)


def clean_record(record: dict) -> dict:
    out = dict(record)
    out["stats"] = {k: json_float(v) for k, v in record.get("stats", {}).items()}
    return out


def encode_parts(parts: list) -> str:
    """parts: ("record", record with plain stats), ("frame", table, heads, rows): the records
    heads[k] with stats = row rows[k] of the table, or ("frame64", names, blob, heads, rows):
    the same with the table's columns as float64 bytes. One line per record, in order."""
    lines: list[str] = []
    for part in parts:
        if part[0] == "record":
            lines.append(dumps(clean_record(part[1])))
            continue
        if part[0] == "frame64":
            _, names, blob, heads, rows = part
            table = _unpack(names, blob)
        else:
            _, table, heads, rows = part
        for head, body in zip(heads, stats_objects(table, rows)):
            h = dumps(head)
            lines.append(f'{h[:-1]},"stats":{body}}}' if len(h) > 2 else f'{{"stats":{body}}}')
    return "".join(line + "\n" for line in lines)


def count_records(parts: list) -> int:
    """How many records (lines) encode_parts(parts) writes."""
    return sum(1 if p[0] == "record" else len(p[3] if p[0] == "frame64" else p[2]) for p in parts)


def _unpack(names, blob: bytes) -> dict:
    """The columns of a ("frame64", ...) part: name -> list of floats (float64 bytes, one column
    after the other)."""
    vals = array("d")
    vals.frombytes(blob)
    n = len(vals) // len(names) if names else 0
    return {k: vals[c * n:(c + 1) * n].tolist() for c, k in enumerate(names)}


def stats_objects(table: dict, rows: list) -> list:
    """One JSON object per row of the table; the same text as dumps(clean_record(...))."""
    keys = list(table)
    template = "{" + ",".join(dumps(k).replace("%", "%%") + ":%s" for k in keys) + "}"
    columns = []
    for k in keys:
        col = table[k]  # a list from numpy's tolist(): one type throughout
        kind = type(col[0]) if col else float
        try:
            if kind not in (float, int, bool):
                raise TypeError(kind)
            vals = col if kind is float else list(map(float, col))  # as json_float writes them
            toks = list(map(float.__repr__, vals))  # TypeError on a value that is not a float
        except TypeError:
            columns.append([dumps(json_float(v) if isinstance(v, float) else v) for v in col])
            continue
        if not all(map(math.isfinite, vals)):  # nan, inf, -inf: written as strings
            toks = [t if math.isfinite(v) else f'"{t}"' for t, v in zip(toks, vals)]
        columns.append(toks)
    by_row = list(zip(*columns)) if columns else [()] * (max(rows) + 1 if rows else 0)
    return [template % by_row[r] for r in rows]
