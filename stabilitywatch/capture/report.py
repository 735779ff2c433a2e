"""Text for people: the replay table and verdicts, the inspect summary, and a progress line."""
from __future__ import annotations

import math
import sys
import threading
import time
from typing import Any, Optional, TextIO


class Progress:
    """A progress line on stderr, silent when disabled. On a terminal: '\\r'-updated and redrawn
    while a phase runs, so a long phase shows its elapsed time. Otherwise (a log): one line for
    each phase that runs longer than `after_s`, then a "still running" line every `quiet_s`
    seconds; quick phases and errors in them leave no lines."""

    def __init__(self, total: int, enabled: bool = True, stream: Optional[TextIO] = None,
                 name: str = "replay", tick_s: float = 0.25, after_s: float = 1.0,
                 quiet_s: float = 10.0):
        self.total, self.enabled, self.name = total, enabled, name
        self.stream = stream or sys.stderr
        self.tty = getattr(self.stream, "isatty", lambda: False)()
        self.t0 = self.t_phase = time.perf_counter()
        self.done = 0
        self.label = self.detail = ""
        self.tick_s, self.after_s, self.quiet_s = tick_s, after_s, quiet_s
        self._said = 0.0        # log mode: when this phase last wrote a line (0: not yet)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def phase(self, label: str) -> None:
        with self._lock:
            self.done += 1
            self.label, self.detail = label, ""
            self.t_phase, self._said = time.perf_counter(), 0.0
            if self.tty:
                self._show()
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="stabilitywatch-progress",
                                            daemon=True)
            self._thread.start()

    def sub(self, i: int, n: int) -> None:
        """Item i (0-based) of n of the current phase."""
        if n:
            self._detail(f"[{'#' * int(20 * (i + 1) / n):<20}] {i + 1}/{n}")

    def amount(self, done: int, total: int) -> None:
        """Bytes done of total in the current phase."""
        if total:
            unit, div = next((u, d) for u, d in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3))
                             if total >= d or u == "kB")
            self._detail(f"{done / div:.1f} of {total / div:.1f} {unit}")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self.enabled and self.tty and self.done:
            self._write("\n")

    def _detail(self, text: str) -> None:
        with self._lock:
            self.detail = text
            if self.tty:
                self._show()

    def _beat(self) -> None:
        while not self._stop.wait(self.tick_s):
            with self._lock:
                if self._stop.is_set():
                    return
                if self.tty:
                    self._show()
                    continue
                now = time.perf_counter()
                if not self._said and now - self.t_phase >= self.after_s:
                    self._said = now
                    self._show()
                elif self._said and now - self._said >= self.quiet_s:
                    self._said = now
                    self._show(still=True)

    def _show(self, still: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        text = f"{self.name} [{self.done}/{self.total}] {self.label}"
        if self.detail:
            text += f" {self.detail}"
        if still:
            text += f": still running, {now - self.t_phase:.0f} s in this phase"
        text += f" ({now - self.t0:.1f} s)"
        self._write(("\r" + text + "\x1b[K") if self.tty else text + "\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):   # a closed or broken stderr: progress is optional
            self.enabled = False


AFTER_FIRST = 4    # rows of the replay table listed after the first divergent one


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
    if r.get("ran"):
        out.append(f"  ran: model_factory {r['ran']['model_factory']}, step_fn "
                   f"{r['ran']['step_fn']}")
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
        out.append(f"2. low precision vs {r['reference_dtype']} replay, role by role in dataflow "
                   f"order (tolerance: relative L2 error {r['tolerance']:g}):")
        out.append(f"   {'module':<28} {'tensor':<22} {'rel L2':>9} {'as fmt':>14} {'SQNR dB':>8} "
                   f"{'cosine':>8} {'max abs err':>11} {'non-finite':>11}")
        first = r["first_divergent"]
        hidden, after, rest = 0, None, []
        for m in r["modules"]:
            if after is not None and after >= AFTER_FIRST:
                rest.append(m)     # downstream of the first departure: counted, not listed
                continue
            if _same_parameter(m):
                hidden += 1
                continue
            if after is not None:
                after += 1
            elif first and (m["module"], m["tensor"]) == (first["module"], first["tensor"]):
                after = 0
            as_fmt = (f"{_num(m.get('rel_l2_format'))} {m['format']}" if m.get("format") else "-")
            mark = "  <- first divergent" if first and (m["module"], m["tensor"]) == (
                first["module"], first["tensor"]) else ("  *" if m.get("divergent") else "")
            nf = (f"{m['nonfinite_low']}/{m['nonfinite_ref']}"
                  if m.get("nonfinite_low") or m.get("nonfinite_ref") else "-")
            out.append(f"   {m['module'] or '<model>':<28} {m['tensor']:<22} "
                       f"{_num(m.get('rel_l2')):>9} {as_fmt:>14} "
                       f"{_num(m.get('sqnr_db'), '.1f'):>8} "
                       f"{_num(m.get('cosine'), '.5f'):>8} {_num(m.get('max_abs_err')):>11} "
                       f"{nf:>11}{mark}")
        if rest:
            out.append(f"   ... {len(rest)} more rows after it in dataflow order, "
                       f"{sum(bool(m.get('divergent')) for m in rest)} of them divergent")
        if hidden:
            out.append(f"   ({hidden} parameter rows equal in both runs not shown; the JSON has "
                       f"every row)")
        if first:
            out.append(f"   first divergent module: {first['module'] or '<model>'} "
                       f"({first['tensor']}, relative L2 error {_num(first['judged_rel_l2'])})")
        else:
            out.append("   first divergent module: none (every module within tolerance)")
        if r.get("explanation"):
            out.append(f"   explanation: {r['explanation']['text']}")
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
    v = r.get("verdict")
    if v:
        out.append("")
        text = (f"{v['headline']} (explanation above)" if v.get("headline")
                and r.get("explanation") else v["text"])
        out.append(f"verdict ({v['kind']}): {text}")
        for d in v.get("evidence", [])[:4]:
            nf = d["nonfinite"]
            out.append(f"     {d['module'] or '<model>'} {d['tensor']}: non-finite recorded "
                       f"{nf[0]}, replayed {nf[1]}; absmax recorded {_num(d['absmax'][0])}, "
                       f"replayed {_num(d['absmax'][1])}")
        for d in v.get("versions", []):
            out.append(f"     {d['package']}: recorded {d['recorded']}, running {d['running']}")
    return printable("\n".join(out))


def _same_parameter(m: dict) -> bool:
    """A parameter's row (weight, bias...: not computed in the step) equal in both runs."""
    role = m["tensor"]
    computed = role == "loss" or role.startswith(("output", "grad", "optim.", "input"))
    return not computed and m.get("rel_l2") == 0 and not m.get("divergent")


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
           f"  alerts ({len(m['alerts'])}):"]
    for a in m["alerts"]:
        out.append(f"    {a['severity']:<8} {a['detector']:<9} {a['module'] or '<model>'} "
                   f"{a['tensor']} {a['stat']}={_num(a['value'])}")
    if isinstance(m.get("lacks"), list) and m["lacks"]:
        why = m.get("lacks_why")
        out.append(f"  written without: {', '.join(map(str, m['lacks']))} (replay runs without "
                   f"them and says so)" + (f": {printable(why)}" if isinstance(why, str) else ""))
    held = m.get("held")
    if isinstance(held, dict) and isinstance(held.get("skipped_steps"), int):
        out.append(f"  state: held by the guard, {held['skipped_steps']} step(s) skipped "
                   f"({printable(str(held.get('first')))}..{printable(str(held.get('last')))})")
    for stem in ("model", "optimizer"):
        size = m["files"][f"{stem}.safetensors"]["bytes"]
        out.append(f"  {stem} state: {len(cap.header(stem))} tensors, {size / 1e6:.2f} MB")
    opt = m.get("optimizer")
    if opt:
        hyper = {k: v for k, v in opt["param_groups"][0].items() if k != "params"} \
            if opt["param_groups"] else {}
        out.append(f"  optimizer: {opt['class']}, {len(opt['param_groups'])} group(s); "
                   f"lr {hyper.get('lr')}")
    lacks = m["lacks"] if isinstance(m.get("lacks"), list) else []
    out.append("  batch: none (written without it)" if "batch" in lacks else
               f"  batch: {describe_tree(m['batch'], cap.header('batch'))}")
    st = m["stats"]
    bad = [f"{k[0] or '<model>'}:{k[1]}" for k, row in zip(st["keys"], st["rows"])
           if any(isinstance(x, str) for x in row[:5]) or any(
               isinstance(x, (int, float)) and x > 0 for x in row[1:4])]
    out.append(f"  statistics: {len(st['keys'])} rows" + (
        f"; NaN/Inf in {len(bad)}: {', '.join(bad[:4])}" + (", ..." if len(bad) > 4 else "")
        if bad else "; all finite"))
    out += _replay_commands(cap)
    return printable("\n".join(out))


def _replay_commands(cap: Any) -> list[str]:
    """The recorded names (text, never imported here) and the command lines that replay them."""
    import shlex

    from .trust import is_import_path, shown

    m = cap.manifest
    names = {k: m.get(k) for k in ("model_factory", "step_fn")}
    out = []
    for key, v in names.items():
        out.append(f"  {key}: " + ("none recorded" if v is None else shown(v) if is_import_path(v)
                                   else f"{shown(v)} (not an import path: replay cannot use it)"))
    where = shlex.quote(str(cap.path))
    flags = " ".join(f"--{k.replace('_', '-')} {v if is_import_path(v) else 'PKG.MOD:FN'}"
                     for k, v in names.items())
    out.append("  replay runs only code you name; check that the names above are your own "
               "functions, then:")
    out.append(f"    stabilitywatch replay {where} {flags}")
    if all(is_import_path(v) for v in names.values()):
        out.append(f"    stabilitywatch replay {where} --trust-recorded   (the same: runs the "
                   f"recorded names)")
    return out


def printable(text: str) -> str:
    """Text from a bundle is shown, never obeyed: control characters (terminal escapes) and
    invisible ones are written as escapes."""
    return "".join(c if c == "\n" or c.isprintable() else repr(c)[1:-1] for c in text)
