"""Find the floating-point tensors inside module outputs: tensors, tuples, lists, dicts,
dataclasses and namedtuples, each with a suffix naming where it sits ("", ".0", ".logits")."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

MAX_DEPTH = 4


def float_tensors(obj: Any, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and not obj.is_complex():
            yield prefix, obj
        return
    if depth >= MAX_DEPTH or obj is None:
        return
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        items = ((f, getattr(obj, f)) for f in obj._fields)
    elif isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = ((f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj))
    elif hasattr(obj, "items") and callable(obj.items):  # ModelOutput-like mappings
        try:
            items = list(obj.items())
        except Exception:
            return
    else:
        return
    for k, v in items:
        yield from float_tensors(v, f"{prefix}.{k}", depth + 1)

