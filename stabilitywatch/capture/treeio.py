"""Plain data for bundles: nested batches as (JSON tree, named tensors), floats that JSON cannot
hold (NaN, Inf) as strings, and the Config as a dict that rebuilds it. Nothing here executes
code from a bundle: trees are decoded from a fixed set of node kinds."""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Mapping

import numpy as np
import torch

MAX_DEPTH = 16


class TreeError(ValueError):
    pass


# -- batches ----------------------------------------------------------------------------------
def encode_tree(obj: Any, tensors: dict[str, torch.Tensor], path: str = "batch",
                depth: int = 0) -> Any:
    """JSON node for obj; tensors go to `tensors` under their path. Supports tensors, dicts with
    string keys, lists, tuples (namedtuples and dataclasses become dicts), numbers, strings,
    None."""
    if depth > MAX_DEPTH:
        raise TreeError(f"{path}: nested deeper than {MAX_DEPTH}")
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach()
        return {"t": "tensor", "key": path}
    if obj is None or isinstance(obj, (bool, int, str)):
        return {"t": "value", "v": obj}
    if isinstance(obj, float):
        return {"t": "value", "v": json_float(obj)}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        obj = dict(zip(obj._fields, obj))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        if not all(isinstance(k, str) for k in obj):
            raise TreeError(f"{path}: dict keys must be strings")
        return {"t": "dict", "items": [[k, encode_tree(v, tensors, f"{path}.{k}", depth + 1)]
                                       for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"t": type(obj).__name__ if type(obj) in (list, tuple) else "list",
                "items": [encode_tree(v, tensors, f"{path}.{i}", depth + 1)
                          for i, v in enumerate(obj)]}
    raise TreeError(f"{path}: cannot store a {type(obj).__name__} (tensors, dicts, lists, "
                    f"tuples, numbers and strings only)")


def decode_tree(node: Any, tensors: Mapping[str, torch.Tensor], depth: int = 0) -> Any:
    if depth > MAX_DEPTH or not isinstance(node, dict) or "t" not in node:
        raise TreeError("malformed batch description")
    kind = node["t"]
    if kind == "tensor":
        key = node.get("key")
        if key not in tensors:
            raise TreeError(f"batch tensor {key!r} is missing")
        return tensors[key]
    if kind == "value":
        v = node.get("v")
        return py_float(v) if isinstance(v, str) and v in ("nan", "inf", "-inf") else v
    if kind == "dict":
        return {str(k): decode_tree(v, tensors, depth + 1) for k, v in node.get("items", [])}
    if kind in ("list", "tuple"):
        items = [decode_tree(v, tensors, depth + 1) for v in node.get("items", [])]
        return tuple(items) if kind == "tuple" else items
    raise TreeError(f"unknown batch node kind {kind!r}")


def describe_tree(node: Any, tensors: Mapping[str, Any], depth: int = 0) -> str:
    """Short text: dict(idx: int64[8, 32], target: int64[8, 32])."""
    if depth > 4:
        return "..."
    kind = node.get("t") if isinstance(node, dict) else None
    if kind == "tensor":
        info = tensors.get(node.get("key"))
        return f"{info['dtype']}{info['shape']}" if isinstance(info, dict) else "tensor"
    if kind == "value":
        return repr(node.get("v"))
    if kind == "dict":
        inner = ", ".join(f"{k}: {describe_tree(v, tensors, depth + 1)}" for k, v in node["items"])
        return f"dict({inner})"
    if kind in ("list", "tuple"):
        inner = ", ".join(describe_tree(v, tensors, depth + 1) for v in node["items"])
        return f"{kind}({inner})"
    return "?"


# -- numbers ----------------------------------------------------------------------------------
def json_float(v: float):
    v = float(v)
    return v if math.isfinite(v) else str(v)


def py_float(v) -> float:
    return float(v)  # float("nan"), float("inf"), float("-inf") and numbers


def rows_to_json(rows: np.ndarray) -> list[list]:
    """float64 rows; Python's repr round-trips every finite float64 exactly."""
    return [[json_float(x) for x in row] for row in np.asarray(rows, dtype=np.float64).tolist()]


def rows_from_json(rows: list) -> np.ndarray:
    return np.array([[py_float(x) for x in r] for r in rows], dtype=np.float64).reshape(len(rows), -1)


def jsonable(v: Any) -> Any:
    """Optimizer metadata and the like: tensors to lists, tuples to lists, NaN/Inf to strings."""
    if isinstance(v, torch.Tensor):
        return {"tensor": jsonable(v.detach().cpu().tolist())}
    if isinstance(v, Mapping):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, float):
        return json_float(v)
    if isinstance(v, enum.Enum):
        return v.value
    if v is None or isinstance(v, (bool, int, str)):
        return v
    return repr(v)


# -- the Config -------------------------------------------------------------------------------
def config_to_json(cfg) -> dict:
    """Every field as plain JSON, a sub-config as a table of its fields. `select` (a callable)
    cannot be stored: it is written as its name and dropped on load; replay watches the
    recorded module names instead."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name == "select":
            v = None if v is None else f"<callable {getattr(v, '__qualname__', repr(v))}>"
        elif f.name == "module_types":
            v = [t if isinstance(t, str) else t.__name__ for t in v]
        elif dataclasses.is_dataclass(v):
            v = {g.name: getattr(v, g.name) for g in dataclasses.fields(v)}
        out[f.name] = jsonable(v)
    return out


def config_from_json(data: Mapping[str, Any], **overrides: Any):
    """Rebuild a Config from config_to_json output: fields this version does not know are
    ignored (a bundle from a newer version still replays), flat names of a bundle from an
    older version go to their sub-config, `select` and the user's own
    detectors are dropped."""
    from ..config import SUBCONFIGS, Config
    from ..config_detectors import DETECTOR_NAMES
    from ..config_flat import FLAT_NAMES

    top = {f.name: f for f in dataclasses.fields(Config)}
    kw: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for k, v in data.items():
        if k in SUBCONFIGS and isinstance(v, Mapping):
            nested.setdefault(k, {}).update(v)
        elif k in top and k != "select" and k not in SUBCONFIGS:
            kw[k] = _number(v, top[k].default)
        elif k in FLAT_NAMES and not (k == "wandb_stats" and not v):
            group, _, sub = FLAT_NAMES[k].partition(".")
            nested.setdefault(group, {}).setdefault(sub, v)
        elif k in ("capture", "sinks") and isinstance(v, list):  # older bundles: the list itself
            nested.setdefault(k, {}).setdefault("triggers" if k == "capture" else "use", v)
    if isinstance(kw.get("detectors"), list):
        # a user's Detector instances are objects, stored as their repr: replay runs the
        # built-in detectors only
        kw["detectors"] = [d for d in kw["detectors"] if d in DETECTOR_NAMES]
    for group, table in nested.items():
        known = {f.name: f for f in dataclasses.fields(SUBCONFIGS[group])}
        kw[group] = SUBCONFIGS[group](**{k: _number(v, known[k].default)
                                         for k, v in table.items() if k in known})
    kw.update(overrides)
    return Config(**kw)


def _number(v, default):
    """Numbers JSON cannot hold were written as "inf", "-inf", "nan"."""
    if v in ("inf", "-inf", "nan") and isinstance(default, (int, float)) \
            and not isinstance(default, bool):
        return py_float(v)
    return v
