"""What goes into a bundle besides the weights: the alerts' note on it, the batch and RNG states
as host copies, the optimizer's metadata, versions and device (capture/manager.py writes it)."""
from __future__ import annotations

import importlib.metadata
import platform
from typing import Any, Optional

import torch

from ..stats.layout import HIST_BINS, HIST_EMIN, N_SCALAR, Stat
from .context import CaptureContext
from .state import StepRecord, to_host, with_hyper
from .treeio import encode_tree, jsonable, rows_to_json


def stat_names() -> list[str]:
    return [Stat(i).name.lower() for i in range(N_SCALAR)] + \
        [f"hist[{HIST_EMIN + b}]" for b in range(HIST_BINS)]


def frame_rows(frame: Any) -> dict:
    return {"step": frame.step, "keys": [list(k) for k in frame.keys],
            "phases": list(frame.phases), "scales": list(frame.scales),
            "rows": rows_to_json(frame.rows)}


def note(p: Any) -> str:
    """What the root alert says about its bundle."""
    parts = []
    if p.held is not None and p.source != "slot":
        n = p.held[1] - p.held[0] + 1
        parts.append(f"the guard held the weights for its bundle: {n} step{'s' * (n > 1)} "
                     f"skipped ({p.held[0]}..{p.held[1]})" if n > 1 else
                     "the guard held the weights for its bundle: 1 step skipped")
    if p.lacks:
        what = []
        if "model" in p.lacks:
            what.append("the start-of-step weights and optimizer state")
        if "batch" in p.lacks:
            what.append("the batch and RNG states")
        has = ("the batch, RNG states and the rows" if "batch" not in p.lacks else "the rows")
        parts.append(f"its bundle lacks {' and '.join(what)} (it holds {has}): {p.why}")
    return "".join(f"; {x}" for x in parts)


def batch_and_rng(rec: Optional[StepRecord]):
    """(manifest batch node, manifest rng node, batch tensors, rng tensors): host copies."""
    if rec is None:
        return {"kind": "none"}, {"cuda_devices": 0}, {}, {}
    found: dict[str, torch.Tensor] = {}
    tree = encode_tree(rec.batch, found)
    events: dict = {}
    batch = {k: to_host(v, events) for k, v in found.items()}
    for ev in events.values():   # sync-ok: once per bundle, at a step boundary
        ev.synchronize()
    rng = rec.rng
    rng_tensors = {"torch": rng["torch"]}
    for i, st in enumerate(rng.get("cuda", [])):
        rng_tensors[f"cuda.{i}"] = st
    np_state = rng["numpy"]
    node = {"python": jsonable(rng["python"]),
            "numpy": [np_state[0], np_state[1].tolist(), *jsonable(list(np_state[2:]))],
            "cuda_devices": len(rng.get("cuda", []))}
    return tree, node, batch, rng_tensors


def batch_bytes(batch: Any) -> int:
    if batch is None:
        return 0
    found: dict[str, torch.Tensor] = {}
    try:
        encode_tree(batch, found)
    except Exception:
        return 0
    return sum(t.numel() * t.element_size() for t in found.values())


def optim_meta(ctx: CaptureContext, names: dict, p: Any) -> Optional[dict]:
    """Param groups (names and hyper-parameters) for a bundle without the optimizer state."""
    from .snapshot import _optim_tensors
    _, meta = _optim_tensors(ctx.optimizer, names)
    if meta is None:
        return None
    meta = with_hyper({**meta, "other_state": {}}, p.record.hyper if p.record else None)
    return jsonable(meta)


def versions() -> dict:
    def ver(pkg: str) -> Optional[str]:
        try:  # metadata only: importing triton here would be slow and is not needed
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None
    from .. import __version__
    return {"stabilitywatch": __version__, "torch": torch.__version__, "triton": ver("triton"),
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()
            if torch.backends.cudnn.is_available() else None,
            "numpy": ver("numpy"), "safetensors": ver("safetensors"),
            "python": platform.python_version()}


def device_info(model: torch.nn.Module) -> dict:
    p = next(iter(model.parameters()), None)
    dev = p.device if p is not None else torch.device("cpu")
    out = {"type": dev.type, "index": dev.index, "host": platform.machine(),
           "cpu": platform.processor() or None, "gpu": None}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        out["gpu"] = props.name
        out["capability"] = f"{props.major}.{props.minor}"
    return out
