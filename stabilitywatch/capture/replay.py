"""`replay(capture)`: explain a captured step after the fact.

1. Re-run the step as recorded under a fresh Monitor with the capture's Config and compare its
   statistics rows with the recorded ones, in dataflow order: equal bit for bit -> `reproduces`;
   otherwise the first rows that differ.
2. Run it again as recorded and in float64 (or float32), autocast off, forward, backward and the
   optimizer step each, and compare every role (compare.py): the first (module, role) in
   dataflow order whose relative L2 error exceeds `tol` is `first_divergent`, explained from the
   two runs' values (verdict.explain).
3. The verdict (verdict.decide): numerics, values, the replay lacks something the run had (state,
   batch, code outside the model, package versions), or non-determinism/hardware.
4. With `upcast` globs: re-run with those modules in fp32 and say whether the captured alerts
   come back.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from .compare import compare, in_dataflow_order, record
from .reader import open_capture
from .report import Progress
from .rerun import Setup
from ..stats.layout import Stat
from .treeio import json_float, rows_from_json
from .verdict import decide, explain, row_difference, version_differences

REF_DTYPES = {"fp64": torch.float64, "fp32": torch.float32}
# Rows equal but for float64 sums this close still reproduce: the Triton statistics kernel merges
# its programs' partial sums with atomics, in an order that varies from run to run (~1e-16
# relative); a one-ulp change of one bf16 element in 1e8 moves sumsq by ~4e-11 relative.
SUM_RTOL = 1e-13


def replay(capture: "str | Path", *, model_factory: "str | Callable | None" = None,
           step_fn: "str | Callable | None" = None, trust_recorded: bool = False,
           device: Optional[str] = None, upcast: Sequence[str] = (), reference: str = "fp64",
           tol: float = 0.1, emulate_formats: bool = True, optimizer: Optional[Callable] = None,
           progress: Optional[bool] = None, json_file: "str | Path | None" = None,
           watch: Optional[Callable] = None) -> dict:
    """Replay a capture bundle; returns the report (a JSON-able dict). See the module docstring
    and the README's "Post-mortem" section.

    A bundle is untrusted: replay runs `model_factory` and `step_fn` as you give them (import
    paths 'pkg.mod:fn' or callables); the names recorded in the bundle are used only with
    `trust_recorded=True` (after reading them in `stabilitywatch inspect`). Raises CaptureError
    (a ValueError) for a missing, truncated or tampered bundle, for code not named, or for a
    model factory or step function that cannot be imported or returns the wrong thing.

    `watch`: the monitor that re-runs the step (stabilitywatch.watch; stabilitywatch.replay
    passes it)."""
    if reference not in REF_DTYPES:
        raise ValueError(f"replay: reference must be one of {sorted(REF_DTYPES)}, got {reference!r}")
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"replay: tol must be a positive number, got {tol!r}")
    if not isinstance(trust_recorded, bool):
        raise ValueError(f"replay: trust_recorded must be True or False, got {trust_recorded!r}")
    upcast = (upcast,) if isinstance(upcast, str) else tuple(upcast)
    t0 = time.perf_counter()
    bar = Progress(total=6 + bool(upcast), enabled=True if progress is None else progress)
    if progress is None:
        bar.enabled = bar.tty
    try:
        bar.phase("verifying the bundle")
        cap = open_capture(capture, progress=bar.amount)
        bar.phase("building the model and loading the captured state")
        setup = Setup(cap, model_factory, step_fn, device, optimizer,
                      trust_recorded=trust_recorded, watch=watch)
        m = cap.manifest
        report: dict[str, Any] = {
            "capture": str(cap.path), "step": cap.step, "rank": m["rank"],
            "device": str(setup.device), "recorded_device": _dev_name(m.get("device") or {}),
            "versions": m.get("versions"), "alerts": m["alerts"], "ran": setup.names,
        }
        versions = version_differences(m.get("versions"))
        report["version_differences"] = versions
        if "batch" in setup.lacks:
            # nothing to run the step on: the verdict says what the bundle lacks
            report.update(reproduce=_not_run(m), reproduces=False, reference_dtype=reference,
                          tolerance=tol, emulate_formats=emulate_formats, modules=None,
                          first_divergent_module=None, first_divergent=None, explanation=None)
            report["verdict"] = decide(report["reproduce"], None, None, versions,
                                       setup.lacks, reference)
            _lacks_why(report["verdict"], m)
            report.update(upcast=None, seconds=round(time.perf_counter() - t0, 3))
            return _finish(report, json_file)
        bar.phase("re-running the step as recorded")
        frame, base_alerts, _ = setup.run_monitored()
        report["reproduce"] = _reproduce(m, frame, setup)
        report["reproduces"] = report["reproduce"]["reproduces"]

        bar.phase("recording the low-precision run")
        names = setup.modules or [n for n, _ in setup.model().named_modules() if n]
        low = record(setup, names, None)
        bar.phase(f"recording the {reference} run")
        ref = record(setup, names, REF_DTYPES[reference])
        bar.phase("comparing module by module")
        rows = compare(low, ref, setup.config(), tol, emulate_formats, progress=bar.sub)
        first = next((r for r in rows if r["divergent"]), None)
        report.update(reference_dtype=reference, tolerance=tol, emulate_formats=emulate_formats,
                      modules=rows, first_divergent_module=first["module"] if first else None,
                      first_divergent=None if first is None else {
                          "module": first["module"], "tensor": first["tensor"],
                          "judged_rel_l2": max(first.get("rel_l2", math.inf),
                                               first.get("rel_l2_format", 0.0))})
        del low, ref
        report["explanation"] = explain(first, reference, tol)
        dev = m.get("device") if isinstance(m.get("device"), dict) else {}
        devices = (str(dev.get("type") or ""), setup.device.type)
        report["verdict"] = decide(report["reproduce"], first, report["explanation"], versions,
                                   setup.lacks, reference, devices)
        _lacks_why(report["verdict"], m)
        report["upcast"] = None
        if upcast:
            bar.phase(f"re-running with {', '.join(upcast)} in fp32")
            report["upcast"] = _upcast(setup, m, upcast, base_alerts)
        report["seconds"] = round(time.perf_counter() - t0, 3)
    finally:
        bar.close()
    return _finish(report, json_file)


def _finish(report: dict, json_file: "str | Path | None") -> dict:
    report = _json_safe(report)
    if json_file is not None:
        Path(json_file).write_text(json.dumps(report, indent=1, allow_nan=False))
    return report


def _not_run(m: dict) -> dict:
    n = len(m["stats"]["keys"])
    return {"reproduces": False, "bitwise": False, "rows_sums_within_tolerance": 0,
            "rows_compared": 0, "rows_differing": 0, "missing": [], "extra": [],
            "differences": [], "first_rows": [], "last_agreeing": None,
            "verdict": f"not re-run: the bundle holds no batch ({n} statistics rows recorded)"}


def _dev_name(d: dict) -> str:
    return d.get("gpu") or d.get("type", "?")


def _reproduce(m: dict, frame: Any, setup: Setup) -> dict:
    """The recorded statistics rows against the re-run's, in dataflow order."""
    st = m["stats"]
    keys = [tuple(k) for k in st["keys"]]
    table = rows_from_json(st["rows"])
    rows = dict(zip(keys, table))
    names = st.get("stat_names") or []
    if frame is None:
        return {"reproduces": False, "rows_compared": 0, "rows_differing": len(keys),
                "missing": [list(k) for k in keys], "extra": [], "differences": [],
                "first_rows": [], "last_agreeing": None,
                "verdict": "does NOT reproduce: the re-run produced no statistics for the step"}
    got = dict(zip(frame.keys, frame.rows))
    if table.size and table.shape[1] != frame.rows.shape[-1]:
        return {"reproduces": False, "rows_compared": 0, "rows_differing": len(keys),
                "missing": [], "extra": [], "differences": [], "first_rows": [],
                "last_agreeing": None,
                "verdict": f"cannot compare: the capture's statistics rows hold {table.shape[1]} "
                           f"values, this version's {frame.rows.shape[-1]} (another row layout)"}
    missing = [k for k in keys if k not in got]
    extra = [k for k in frame.keys if k not in rows]
    diffs, first_rows, differing, sums_only, last_ok = [], [], 0, 0, None
    for k in in_dataflow_order(keys):
        if k not in got:
            continue
        row, other = rows[k], got[k]
        bad = np.flatnonzero(~((row == other) | (np.isnan(row) & np.isnan(other))))
        if bad.size and set(bad.tolist()) <= _SUMS and _sums_close(row, other):
            sums_only += 1        # the Triton kernel merges float64 sums with atomics
            bad = bad[:0]
        if not bad.size:
            # the last agreeing output or output gradient before the first difference: the
            # value that flows into where the difference enters
            if not differing and k[1].startswith(("output", "grad_output")):
                last_ok = {"module": k[0], "tensor": k[1]}
            continue
        differing += 1
        if len(first_rows) < 8:
            first_rows.append(row_difference(k, row, other))
        for j in bad[:3]:
            diffs.append({"module": k[0], "tensor": k[1],
                          "stat": names[j] if j < len(names) else str(j),
                          "recorded": float(row[j]), "replayed": float(other[j])})
    ok = not (missing or extra or differing)
    exact = ok and not sums_only
    where = f"recorded on {_dev_name(m.get('device') or {})}, replayed on {setup.device}"
    if ok:
        how = "bit for bit" if exact else (
            f"bit for bit except the float64 sums of {sums_only} rows, within {SUM_RTOL:g} (the "
            f"statistics kernel adds with atomics; counts, extremes and histograms are exact)")
        verdict = f"reproduces {how} ({len(keys)} statistics rows)"
    else:
        parts = [f"{differing} of {len(keys)} rows differ"] if differing else []
        parts += [f"{len(missing)} rows missing"] if missing else []
        parts += [f"{len(extra)} unexpected rows"] if extra else []
        verdict = f"does NOT reproduce ({', '.join(parts)}; {where})"
    return {"reproduces": ok, "bitwise": exact, "rows_sums_within_tolerance": sums_only,
            "rows_compared": len(keys) - len(missing),
            "rows_differing": differing, "missing": [list(k) for k in missing],
            "extra": [list(k) for k in extra], "differences": diffs[:50],
            "first_rows": first_rows, "last_agreeing": last_ok if differing else None,
            "verdict": verdict}


_SUMS = {int(Stat.SUM), int(Stat.SUMSQ), int(Stat.SHIFT_SUM), int(Stat.SHIFT_SUMSQ)}


def _sums_close(a: np.ndarray, b: np.ndarray) -> bool:
    # |sum| can cancel to ~0: bound its error by sqrt(n * sumsq) >= sum |x| instead; the
    # shifted sum (taken as SUM - n K) by that plus n |K|; the shifted sum of squares of a row
    # that took tensors of other shifts also carries 2 D (sum |x| + n |K|) + n D^2 for the
    # spread D = max - min (stats/layout.py's merge)
    n = max(a[Stat.NUMEL], 1.0)
    scale_sum = math.sqrt(n * abs(a[Stat.SUMSQ]))
    k = abs(a[Stat.SHIFT])
    d = a[Stat.MAX] - a[Stat.MIN]
    d = d if math.isfinite(d) else 0.0
    ssq = abs(a[Stat.SHIFT_SUMSQ]) + 2 * d * (scale_sum + n * k) + n * d * d
    return (abs(a[Stat.SUM] - b[Stat.SUM]) <= SUM_RTOL * scale_sum
            and abs(a[Stat.SUMSQ] - b[Stat.SUMSQ]) <= SUM_RTOL * abs(a[Stat.SUMSQ])
            and abs(a[Stat.SHIFT_SUM] - b[Stat.SHIFT_SUM]) <= SUM_RTOL * (scale_sum + n * k)
            and abs(a[Stat.SHIFT_SUMSQ] - b[Stat.SHIFT_SUMSQ]) <= SUM_RTOL * ssq)


def _akey(a: Any) -> str:
    if isinstance(a, dict):
        return f"{a['detector']} {a['module'] or '<model>'} {a['tensor']} {a['stat']}"
    return f"{a.detector} {a.module or '<model>'} {a.tensor} {a.stat}"


def _upcast(setup: Setup, m: dict, globs: tuple[str, ...], base_alerts: list) -> dict:
    from .reader import CaptureError

    matched = setup.matching(setup.model(), list(globs))
    if not matched:
        raise CaptureError(f"--upcast {', '.join(globs)} matches no module of the model")
    _, alerts, loss = setup.run_monitored(upcast=globs)
    # the anomaly: captured alerts that the as-recorded re-run raises again. Alerts that need a
    # history (drift, spike, cooldown reminders) cannot come back in a one-step replay: they are
    # listed as not judged rather than counted as gone.
    base = {_akey(a) for a in base_alerts}
    captured = list(dict.fromkeys(_akey(a) for a in m["alerts"]))
    judged = [k for k in captured if k in base]
    now = {_akey(a) for a in alerts}
    remaining = [k for k in judged if k in now]
    return {"globs": list(globs), "modules": matched,
            "anomaly_disappears": (not remaining) if judged else None,
            "judged": judged, "remaining": remaining,
            "not_judged": [k for k in captured if k not in base],
            "new": sorted(now - set(captured) - base), "loss": float(loss.float())}


def _json_safe(v: Any) -> Any:
    if isinstance(v, float):
        return json_float(v)
    if isinstance(v, dict):
        return {k: _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if isinstance(v, (np.floating, np.integer)):
        return _json_safe(v.item())
    return v


def _lacks_why(verdict: dict, m: dict) -> None:
    """The bundle's own word on why it lacks parts (manifest `lacks_why`), in the verdict."""
    why = m.get("lacks_why")
    if verdict.get("kind") == "lacks" and m.get("lacks") and isinstance(why, str) and why:
        verdict["lacks_why"] = why
        verdict["text"] += f" (the bundle says: {why})"
