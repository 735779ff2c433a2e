"""Replay's verdict: which cause the evidence points to, said with the evidence.

- "numerics": the step reproduces (same code, inputs and state give the same statistics rows)
  and the high-precision run departs: the first departing (module, role), with an explanation
  derived from the two runs' values (overflow of the low dtype, an overflowing intermediate,
  rounding error, a format that cannot hold the values).
- "values": it reproduces and the high-precision run agrees: the anomaly is in the step's values
  (data, weights) at any precision.
- "lacks": it does not reproduce, and something the run had is missing from the replay: state
  or a batch the bundle was written without (manifest `lacks`); code outside the model factory
  (the first differing row, in dataflow order, holds non-finite values or a large departure the
  re-run does not produce, while every row before it agrees: the values changed there from
  outside the model); other package versions than the recorded ones, or another device type.
- "nondeterminism": it does not reproduce with the same code, inputs and state, and nothing
  indicates a missing part: non-determinism (atomics, algorithm choice, unseeded randomness) or
  hardware.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch

from ..formats import spec
from ..stats.layout import Stat

PACKAGES = ("torch", "triton", "stabilitywatch", "numpy")
MAX_OF = {str(d).replace("torch.", ""): torch.finfo(d).max
          for d in (torch.float16, torch.bfloat16, torch.float32)}
LARGE_BITS = 1.0      # a row whose absmax or L2 norm moved by 2x or more departs "largely"


def version_differences(recorded: Any) -> list[dict]:
    """The packages whose recorded version differs from the running one (nothing when the bundle
    records no versions)."""
    from .contents import versions as _versions

    if not isinstance(recorded, dict):
        return []
    now = _versions()
    return [{"package": k, "recorded": recorded.get(k), "running": now.get(k)}
            for k in PACKAGES if k in recorded and recorded.get(k) != now.get(k)]


def row_difference(key: tuple, rec: np.ndarray, rep: np.ndarray) -> dict:
    """How a recorded statistics row and its re-run differ: non-finite counts, absmax, L2 norm,
    and whether the difference is large (non-finite values on one side only, or absmax or L2
    norm 2x apart)."""
    def nonfinite(r):
        return int(r[Stat.NAN] + r[Stat.POSINF] + r[Stat.NEGINF])

    def l2(r):
        return math.sqrt(max(float(r[Stat.SUMSQ]), 0.0))
    out = {"module": key[0], "tensor": key[1],
           "nonfinite": [nonfinite(rec), nonfinite(rep)],
           "absmax": [float(rec[Stat.ABSMAX]), float(rep[Stat.ABSMAX])],
           "l2norm": [l2(rec), l2(rep)]}
    out["large"] = (out["nonfinite"][0] != out["nonfinite"][1]
                    or any(_bits(a, b) >= LARGE_BITS for a, b in (out["absmax"], out["l2norm"])))
    return out


def _bits(a: float, b: float) -> float:
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf
    if a == b:
        return 0.0
    if a <= 0 or b <= 0:
        return math.inf
    return abs(math.log2(a / b))


def _where(d: dict) -> str:
    return f"{d['module'] or '<model>'} {d['tensor']}"


def _row_text(d: dict) -> str:
    nf = d["nonfinite"]
    if nf[0] != nf[1]:
        return f"non-finite values: recorded {nf[0]}, replayed {nf[1]}"
    return (f"absmax recorded {d['absmax'][0]:.4g}, replayed {d['absmax'][1]:.4g}; L2 norm "
            f"recorded {d['l2norm'][0]:.4g}, replayed {d['l2norm'][1]:.4g}")


def explain(row: Optional[dict], reference: str, tol: float) -> Optional[dict]:
    """Why the first departing row departs, from the two runs' values."""
    if row is None:
        return None
    where, mod, role = _where(row), row["module"], row["tensor"]
    dt = row.get("dtype", "?")
    dmax = MAX_OF.get(dt)
    grad_role = role.startswith("grad")     # gradients scale with the loss (optimizer state not)
    up = f"computing {mod} in fp32 (--upcast {mod})" if mod else "computing the model in fp32"
    lo_nf, ref_nf = row.get("nonfinite_low", 0), row.get("nonfinite_ref", 0)
    amax = row.get("absmax_ref", 0.0)
    if row.get("error"):
        return {"kind": "missing", "module": mod, "tensor": role,
                "text": f"{where}: {row['error']}"}
    if lo_nf and not ref_nf:
        if dmax is not None and amax > dmax:
            ratio = amax / dmax
            text = (f"{where} overflowed {dt}: {lo_nf} values are non-finite in {dt} and finite "
                    f"in {reference}, up to {amax:.4g}, {ratio:.3g}x {dt}'s max ({dmax:g}); ")
            fits32 = amax <= MAX_OF["float32"]
            remedy = ["upcast"] if fits32 else []
            text += (f"{up} removes the overflow" if fits32 else
                     f"beyond fp32's max too, so computing it in fp32 does not remove the "
                     f"overflow: the values themselves are out of range (look at the weights "
                     f"and data that feed it)")
            if grad_role:
                k = 2 ** math.ceil(math.log2(ratio) + 1e-12)
                remedy.append("loss_scale")
                text += (f"; {'so does scaling' if fits32 else 'scaling'} the loss down by "
                         f"{k:g} or more (a GradScaler lowers its scale until the gradients "
                         f"fit){'' if fits32 else ' does'}")
            return {"kind": "overflow", "module": mod, "tensor": role, "dtype": dt,
                    "reference_absmax": amax, "dtype_max": dmax, "ratio": ratio,
                    "remedy": remedy, "text": text}
        return {"kind": "intermediate_overflow", "module": mod, "tensor": role, "dtype": dt,
                "reference_absmax": amax, "dtype_max": dmax, "remedy": ["upcast"],
                "text": (f"{where}: {lo_nf} values are non-finite in {dt} although the "
                         f"{reference} values fit {dt} (up to {amax:.4g}): something computed "
                         f"inside {mod or 'the model'} overflowed; {up} removes it")}
    if ref_nf:
        return {"kind": "nonfinite_in_reference", "module": mod, "tensor": role, "remedy": [],
                "text": (f"{where} is non-finite in {reference} as well ({ref_nf} values, "
                         f"{lo_nf} in {dt}): not a matter of precision, upcasting does not "
                         f"remove it; look at the data and weights that feed it")}
    rel, relf = row.get("rel_l2", math.nan), row.get("rel_l2_format")
    fmt = row.get("format")
    if fmt is not None and relf is not None and not relf <= tol and rel <= tol:
        fmax = spec(fmt).max
        top = amax * row.get("scale", 1.0)
        why = (f"its values reach {top:.4g} at the scale in use, {top / fmax:.3g}x {fmt}'s max "
               f"({fmax:g})" if top > fmax else f"{fmt} cannot hold its small values")
        return {"kind": "format", "module": mod, "tensor": role, "format": fmt,
                "remedy": ["scale"] if top > fmax else [],
                "text": (f"{where} is computed well in {dt} (relative L2 error {rel:.3g}) but "
                         f"cast to {fmt} (Config.formats) its error is {relf:.3g}: {why}")}
    return {"kind": "rounding", "module": mod, "tensor": role, "dtype": dt, "remedy": ["upcast"],
            "text": (f"{where} in {dt} departs from {reference} by a relative L2 error of "
                     f"{rel:.3g} (tolerance {tol:g}) with every value finite: rounding error; "
                     f"{up} shows whether it matters")}


def decide(rp: dict, first: Optional[dict], explanation: Optional[dict], versions: list[dict],
           lacks: list[str], reference: str, devices: tuple[str, str] = ("", "")) -> dict:
    """The verdict: {kind, text, lacks, evidence (first differing rows), versions, where}.
    devices: the device types of the run and of the replay."""
    evidence = rp.get("first_rows", [])
    out: dict[str, Any] = {"evidence": evidence, "versions": versions, "lacks": [],
                           "where": None}
    vers = ", ".join(f"{v['package']} {v['running']} (recorded {v['recorded']})"
                     for v in versions)
    if rp["reproduces"]:
        if first is not None:
            out.update(kind="numerics", where={"module": first["module"],
                                               "tensor": first["tensor"]})
            out["headline"] = (f"numerics of this step: it reproduces with the same code, "
                               f"inputs and state, and the low-precision run departs from "
                               f"{reference} first at {_where(first)}")
            out["text"] = out["headline"] + (f": {explanation['text']}" if explanation else "")
        else:
            out.update(kind="values", text=(
                f"it reproduces, and the {reference} run agrees with the low-precision one "
                f"within tolerance everywhere: the anomaly is in the values of this step "
                f"(data, weights), at any precision"))
        if versions:
            note = f" (package versions differ: {vers})"
            out["text"] += note
            if "headline" in out:
                out["headline"] += note
        return out
    entry = evidence[0] if evidence else None
    if lacks:
        out.update(kind="lacks", lacks=[f"{x} state" if x in ("model", "optimizer") else x
                                        for x in lacks])
        out["text"] = (f"the replay lacks something the run had: the bundle was written without "
                       f"{', '.join(out['lacks'])}, so the step could not be re-run as it ran"
                       + (f"; package versions differ too: {vers}" if versions else ""))
        return out
    if entry is not None and entry["large"]:
        out.update(kind="lacks", lacks=["code"] + (["versions"] if versions else []),
                   where={"module": entry["module"], "tensor": entry["tensor"]})
        after = rp.get("last_agreeing")
        out["text"] = (
            f"the replay lacks code the run had: the difference enters at {_where(entry)} "
            f"({_row_text(entry)}), and every row before it in dataflow order agrees"
            + (f", {_where(after)} included" if after else "")
            + ": a hook, or loop code outside the model factory and step function, changed the "
              "values there (with no such code in the loop, suspect a hardware fault at that "
              "point)" + (f"; package versions differ too: {vers}" if versions else ""))
        return out
    missing = rp.get("missing") or []
    if missing:
        shown = ", ".join(f"{m or '<model>'} {t}" for m, t in missing[:4])
        out.update(kind="lacks", lacks=["code"] + (["versions"] if versions else []),
                   where={"module": missing[0][0], "tensor": missing[0][1]})
        out["text"] = (f"the replay lacks code the run had: {len(missing)} recorded rows are not "
                       f"produced by the re-run ({shown}{', ...' if len(missing) > 4 else ''}): "
                       f"code outside the model factory and step function recorded them (the "
                       f"loop's mon.observe calls, hooks)"
                       + (f"; package versions differ too: {vers}" if versions else ""))
        return out
    other_device = bool(devices[0]) and devices[0] != devices[1]
    if versions or other_device:
        out.update(kind="lacks", lacks=(["versions"] if versions else [])
                   + (["device"] if other_device else []))
        parts = ([f"other package versions: {vers}"] if versions else []) + (
            [f"another device type: recorded on {devices[0]}, replayed on {devices[1]}"]
            if other_device else [])
        out["text"] = (f"the replay lacks something the run had: {'; '.join(parts)}; replay "
                       f"with the recorded {'versions' if versions else 'device'} to tell that "
                       f"from non-determinism")
        return out
    first_at = f", the first at {_where(entry)} ({_row_text(entry)})" if entry else ""
    out.update(kind="nondeterminism", where=None if entry is None else {
        "module": entry["module"], "tensor": entry["tensor"]})
    out["text"] = (f"non-determinism or hardware: the step does not reproduce with the same "
                   f"code, inputs and state ({rp['rows_differing']} rows differ{first_at}), and "
                   f"nothing indicates a missing part: suspect non-deterministic kernels (atomics, "
                   f"algorithm choice), unseeded randomness, or a hardware fault")
    return out
