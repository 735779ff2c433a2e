"""Text for people: the replay table and verdicts, the inspect summary, and a progress line."""
from __future__ import annotations

import math
import sys
import time
from typing import Any, Optional, TextIO


class Progress:
    """A one-line progress indicator on stderr ('\\r'-updated on a terminal, one line per phase
    otherwise); silent when disabled."""

    def __init__(self, total: int, enabled: bool = True, stream: Optional[TextIO] = None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.t0 = time.perf_counter()
        self.done = 0
        self.label = ""

    def phase(self, label: str) -> None:
        self.done += 1
        self.label = label
        self._show(f"replay [{self.done}/{self.total}] {label}", final=not self.tty)

    def sub(self, i: int, n: int) -> None:
        if self.tty and n:
            bar = "#" * int(20 * (i + 1) / n)
            self._show(f"replay [{self.done}/{self.total}] {self.label} [{bar:<20}] {i + 1}/{n}")

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def _show(self, text: str, final: bool = False) -> None:
        if not self.enabled:
            return
        text = f"{text} ({time.perf_counter() - self.t0:.1f} s)"
        self.stream.write(("\r" + text + "\x1b[K") if self.tty else text + "\n")
        self.stream.flush()


def _num(v: Any, fmt: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return format(v, fmt)


def replay_text(r: dict) -> str:
    out = [f"capture: {r['capture']} (step {r['step']}, rank {r['rank']}; recorded on "
           f"{r['recorded_device']}, replayed on {r['device']})"]
    rank = {"critical": 0, "warning": 1, "info": 2}
    alerts = sorted(r["alerts"], key=lambda a: rank.get(a["severity"], 3))
    for a in alerts[:4]:
        out.append(f"  alert: {a['severity']} {a['detector']} {a['module'] or '<model>'} "
                   f"{a['tensor']} {a['stat']}={_num(a['value'])}")
    if len(alerts) > 4:
        out.append(f"  ... and {len(alerts) - 4} more alert(s) of this step")
    rp = r["reproduce"]
    out.append("")
    out.append(f"1. re-run as recorded: {rp['verdict']}")
    for d in rp["differences"][:8]:
        out.append(f"     {d['module'] or '<model>'} {d['tensor']} {d['stat']}: recorded "
                   f"{_num(d['recorded'], '.17g')}, replayed {_num(d['replayed'], '.17g')}")
    if r.get("modules") is not None:
        out.append("")
        out.append(f"2. low precision vs {r['reference_dtype']} replay, module by module "
                   f"(tolerance: relative L2 error {r['tolerance']:g}):")
        out.append(f"   {'module':<28} {'tensor':<12} {'rel L2':>9} {'as fmt':>14} {'SQNR dB':>8} "
                   f"{'cosine':>8} {'max abs err':>11}")
        first = r["first_divergent"]
        for m in r["modules"]:
            as_fmt = (f"{_num(m.get('rel_l2_format'))} {m['format']}" if m.get("format") else "-")
            mark = "  <- first divergent" if first and (m["module"], m["tensor"]) == (
                first["module"], first["tensor"]) else ("  *" if m.get("divergent") else "")
            out.append(f"   {m['module']:<28} {m['tensor']:<12} {_num(m.get('rel_l2')):>9} "
                       f"{as_fmt:>14} {_num(m.get('sqnr_db'), '.1f'):>8} "
                       f"{_num(m.get('cosine'), '.5f'):>8} {_num(m.get('max_abs_err')):>11}{mark}")
        if first:
            out.append(f"   first divergent module: {first['module']} ({first['tensor']}, "
                       f"relative L2 error {_num(first['judged_rel_l2'])})")
        else:
            out.append("   first divergent module: none (every module within tolerance)")
    up = r.get("upcast")
    if up:
        out.append("")
        verdict = ("cannot be judged: none of its alerts comes back in a plain re-run"
                   if up["anomaly_disappears"] is None else "PERSISTS"
                   if not up["anomaly_disappears"] else "DISAPPEARS" if not up["new"]
                   else "DISAPPEARS, but other alerts appear")
        out.append(f"3. what-if, {', '.join(up['modules'])} forced to fp32: the captured "
                   f"anomaly {verdict}")
        for a in up["remaining"]:
            out.append(f"     still: {a}")
        for a in sorted(set(up["judged"]) - set(up["remaining"])):
            out.append(f"     gone:  {a}")
        for a in up["new"][:5]:
            out.append(f"     new:   {a}")
    return "\n".join(out)


def inspect_text(cap: Any) -> str:
    from .treeio import describe_tree

    m = cap.manifest
    v = m.get("versions", {})
    dev = m.get("device", {})
    out = [f"capture {cap.path}", f"  step {m['step']}, rank {m['rank']} of "
           f"{m.get('world_size', 1)}, written {m.get('created', '?')} (bundle schema "
           f"{m['schema']}); checksums OK ({len(m['files']) + 1} files)",
           f"  device: {dev.get('type')}" + (f" ({dev['gpu']}, sm {dev.get('capability')})"
                                             if dev.get("gpu") else ""),
           "  versions: " + ", ".join(f"{k} {v[k]}" for k in v if v[k] is not None),
           f"  model_factory: {m.get('model_factory')}   step_fn: {m.get('step_fn')}",
           f"  alerts ({len(m['alerts'])}):"]
    for a in m["alerts"]:
        out.append(f"    {a['severity']:<8} {a['detector']:<9} {a['module'] or '<model>'} "
                   f"{a['tensor']} {a['stat']}={_num(a['value'])}")
    for stem in ("model", "optimizer"):
        size = m["files"][f"{stem}.safetensors"]["bytes"]
        out.append(f"  {stem} state: {len(cap.header(stem))} tensors, {size / 1e6:.2f} MB")
    opt = m.get("optimizer")
    if opt:
        hyper = {k: v for k, v in opt["param_groups"][0].items() if k != "params"} \
            if opt["param_groups"] else {}
        out.append(f"  optimizer: {opt['class']}, {len(opt['param_groups'])} group(s); "
                   f"lr {hyper.get('lr')}")
    out.append(f"  batch: {describe_tree(m['batch'], cap.header('batch'))}")
    st = m["stats"]
    bad = [f"{k[0] or '<model>'}:{k[1]}" for k, row in zip(st["keys"], st["rows"])
           if any(isinstance(x, str) for x in row[:5]) or any(
               isinstance(x, (int, float)) and x > 0 for x in row[1:4])]
    out.append(f"  statistics: {len(st['keys'])} rows" + (
        f"; NaN/Inf in {len(bad)}: {', '.join(bad[:4])}" + (", ..." if len(bad) > 4 else "")
        if bad else "; all finite"))
    out.append(f"  replay: stabilitywatch replay {cap.path}")
    return "\n".join(out)
