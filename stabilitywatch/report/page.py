"""The report page: one HTML file, everything inline (styles and SVG figures); no scripts."""
from __future__ import annotations

import datetime
import html
import json
import math
import os
from pathlib import Path
from urllib.parse import quote

from .replays import bundle_path, verdict_text

SEVERITY_RANK = {"critical": 2, "warning": 1, "info": 0}
MAX_INCIDENTS = 300   # rows of the timeline (and of its info-only part)
MAX_LISTED = 200      # consequences listed under one incident (all are counted)

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px auto;max-width:1400px;
 padding:0 16px;color:#222}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:18px 0 4px}.muted{color:#666}.note{color:#555;font-size:13px}
table{border-collapse:collapse;width:100%;font-size:13px}
th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #eee;vertical-align:top}
th{background:#f6f6f6}code{font-size:12px;background:#f4f4f4;padding:0 3px}
.sev{font-weight:600;border-radius:3px;padding:0 5px;color:#fff}
.critical{background:#d62728}.warning{background:#ff7f0e}.info{background:#7f7f7f}
.root td{background:#fff8f6}.fig svg{max-width:100%;height:auto}
.cols{columns:3 380px;font-size:12px}.cols div{break-inside:avoid;padding:1px 0}
.ok{color:#2a7a2a}.bad{color:#b00}hr{border:0;border-top:1px dashed #ddd;margin:4px 0}
details{margin:4px 0}summary{cursor:pointer}
"""


def _e(x) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _fmt(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, (int, float)):
        return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)
    return str(v)


def _groups(alerts: list) -> list[list[dict]]:
    """Incidents in step order, each its alerts with the root first. Alerts without an
    `incident` key group by (rank, step), in file order."""
    groups: dict = {}
    for a in alerts:
        key = ("i", a["incident"]) if a.get("incident") is not None else \
            ("s", a.get("rank"), a.get("step"))
        groups.setdefault(key, []).append(a)
    out = []
    for members in groups.values():
        roots = [a for a in members if a.get("root") is True]
        head = roots[0] if roots else members[0]
        out.append([head] + [a for a in members if a is not head])
    return out


def _by_severity(alerts: list) -> str:
    """'1 critical, 2 info': counts, worst first."""
    by: dict = {}
    for a in alerts:
        by[a.get("severity")] = by.get(a.get("severity"), 0) + 1
    order = sorted(by.items(), key=lambda x: -SEVERITY_RANK.get(x[0], 0))
    return ", ".join(f"{n} {s}" for s, n in order)


def _href(target: Path, out: Path) -> str:
    return quote(os.path.relpath(target, out.parent).replace(os.sep, "/"))


def _alert_cells(a: dict) -> str:
    sev = a.get("severity") if a.get("severity") in SEVERITY_RANK else "info"
    return (f"<td>{_e(a.get('step'))}</td><td><span class='sev {sev}'>{_e(sev)}</span></td>"
            f"<td>{_e(a.get('detector'))}</td><td><code>{_e(a.get('module') or '<model>')}</code>"
            f"</td><td>{_e(a.get('tensor'))}</td><td>{_e(a.get('stat'))}={_e(_fmt(a.get('value')))}"
            f"</td><td>{_e(a.get('message'))}</td>")


def _bundle_html(cap: str, d, verdicts: dict, out: Path) -> tuple[str, str]:
    """(link, verdict) cells' contents for one capture path."""
    b = bundle_path(d.run_dir, cap)
    if b is None:
        return f"<span class='bad'><code>{_e(cap)}</code> (missing)</span>", ""
    link = f"<a href='{_href(b, out)}'><code>{_e(cap)}</code></a>"
    v = verdicts.get(b)
    if v is None:
        names = "".join(f" --{flag} {d.manifest[key]}" for flag, key in
                        (("model-factory", "model_factory"), ("step-fn", "step_fn"))
                        if isinstance(d.manifest.get(key), str))
        cmd = f"stabilitywatch replay {b}{names} --json {b}.replay.json"
        return link, f"<span class='muted'>not replayed: <code>{_e(cmd)}</code></span>"
    label, sentence = verdict_text(v["report"])
    cls = "ok" if v["report"].get("reproduces") is True else "bad"
    more = f" ({v['others']} older report(s))" if v["others"] else ""
    return link, (f"<span class='{cls}'>{_e(label)}</span><br>"
                  f"<span class='note'>{_e(sentence)}</span><br>"
                  f"<a class='note' href='{_href(v['file'], out)}'>{_e(v['file'].name)}</a>"
                  f"{_e(more)}")


def _capture_cells(group: list, d, verdicts: dict, out: Path) -> str:
    """The bundles of an incident's alerts (the root's first), each with its verdict."""
    caps = list(dict.fromkeys(a["capture"] for a in group
                              if isinstance(a.get("capture"), str) and a["capture"]))
    if not caps:
        return "<td class='muted'>none</td><td></td>"
    cells = [_bundle_html(c, d, verdicts, out) for c in caps]
    return ("<td>" + "<br>".join(c[0] for c in cells) + "</td><td>"
            + "<hr>".join(c[1] for c in cells if c[1]) + "</td>")


def timeline_html(d, verdicts: dict, out: Path) -> str:
    groups = _groups(d.alerts)
    if not groups:
        return "<p>No alerts: <code>alerts.jsonl</code> is missing or empty.</p>"
    head = ("<tr><th>step</th><th>severity</th><th>detector</th><th>module</th><th>tensor</th>"
            "<th>value</th><th>message</th><th>capture</th><th>replay verdict</th></tr>")
    main, quiet = [], []
    for g in groups:
        worst = max(SEVERITY_RANK.get(a.get("severity"), 0) for a in g)
        rows = [f"<tr class='root'>{_alert_cells(g[0])}{_capture_cells(g, d, verdicts, out)}</tr>"]
        if len(g) > 1:
            inner = "".join(f"<tr>{_alert_cells(a)}</tr>" for a in g[1:MAX_LISTED + 1])
            if len(g) - 1 > MAX_LISTED:
                inner += f"<tr><td colspan='7'>... {len(g) - 1 - MAX_LISTED} more</td></tr>"
            count = _by_severity(g[1:])
            rows.append(f"<tr><td></td><td colspan='8'><details><summary>{len(g) - 1} "
                        f"consequence(s): {_e(count)}</summary><table>{inner}</table></details>"
                        f"</td></tr>")
        (main if worst > 0 else quiet).append((-worst, len(main) + len(quiet), "".join(rows)))
    parts = []
    for rows in (main, quiet):   # over the cap: the worst, earliest first, shown in step order
        if len(rows) > MAX_INCIDENTS:
            n = len(rows) - MAX_INCIDENTS
            rows[:] = sorted(sorted(rows)[:MAX_INCIDENTS], key=lambda r: r[1])
            rows.append((0, 0, f"<tr><td colspan='9'>... {n} more group(s), less severe or "
                               "later, not shown (see alerts.jsonl)</td></tr>"))
        rows[:] = [r[2] for r in rows]
    if main:
        parts.append(f"<table>{head}{''.join(main)}</table>")
    else:
        parts.append("<p>No warning or critical alert.</p>")
    if quiet:
        parts.append(f"<details><summary>{len(quiet)} info-only group(s)</summary>"
                     f"<table>{head}{''.join(quiet)}</table></details>")
    return "\n".join(parts)


def _kv_table(obj: dict) -> str:
    rows = "".join(f"<tr><td><code>{_e(k)}</code></td><td><code>{_e(json.dumps(v, default=str))}"
                   f"</code></td></tr>" for k, v in obj.items())
    return f"<table>{rows}</table>"


def run_html(d) -> str:
    m = d.manifest
    if not m:
        return "<p class='bad'>No readable <code>run.json</code>.</p>"
    parts = [f"<p class='note'>from <code>{_e(d.manifest_path.name)}</code></p>"]
    top = {k: m.get(k) for k in ("model_factory", "step_fn", "rank", "world_size", "schema")
           if k in m}
    parts.append(_kv_table(top))
    if isinstance(m.get("versions"), dict):
        parts.append("<h3>Versions</h3>" + _kv_table(m["versions"]))
    mods = m.get("modules")
    if isinstance(mods, list):
        parts.append(f"<details><summary>{len(mods)} watched module(s)</summary><p><code>"
                     + _e(", ".join(map(str, mods))) + "</code></p></details>")
    if isinstance(m.get("config"), dict):
        items = "".join(f"<div><code>{_e(k)}</code> = <code>{_e(json.dumps(v, default=str))}"
                        f"</code></div>" for k, v in m["config"].items())
        parts.append(f"<details open><summary>Config</summary><div class='cols'>{items}</div>"
                     "</details>")
    return "\n".join(parts)


def summary_html(d) -> str:
    steps = sorted(set(d.loss) | set(d.grad_norm))
    span = f"steps {steps[0]}..{steps[-1]}" if steps else "no loss or gradient-norm records"
    counts = _by_severity(d.alerts)
    return (f"<p>{_e(span)}; {len(d.alerts)} alert(s){': ' + _e(counts) if counts else ''}; "
            f"{len(_groups(d.alerts))} incident(s).</p>")


def notes_html(d) -> str:
    notes = []
    if not d.stats_files:
        notes.append("no stats.jsonl in the run directory: no curves or heatmaps")
    else:
        names = ", ".join(p.name for p in d.stats_files)
        notes.append(f"statistics from {names} ({d.stats_lines} records)"
                     + ("; several ranks: a heatmap cell shows the largest value over ranks, "
                        "the curves the lowest rank's" if len(d.stats_files) > 1 else ""))
    if d.bad_lines:
        where = ", ".join(f"{f}:{n}" for f, n in d.bad_lines[:5])
        notes.append(f"{len(d.bad_lines)} unreadable line(s) skipped ({where}"
                     + (", ..." if len(d.bad_lines) > 5 else "") + ")")
    if d.step_bin > 1:
        notes.append(f"heatmaps: {d.heat_steps} recorded steps in {len(d.columns)} columns "
                     f"of {d.step_bin} consecutive recorded steps; a cell shows the largest "
                     "value in its column (--max-steps to change)")
    for g in d.grids.values():
        if len(g.modules) < g.total_modules:
            notes.append(f"heatmap {g.role}: {len(g.modules)} of {g.total_modules} modules "
                         "(the ones named in warning/critical alerts, the rest evenly spaced "
                         "in order; --max-modules to change)")
    others = [f for f in d.formats_in_stats if not any(f in v for v in d.formats.values())]
    if others:
        notes.append(f"fractions are also recorded for {', '.join(others)}: --formats to show them")
    left = [r for r in d.roles_in_stats
            if r not in d.grids and not r.startswith(("drift.", "shadow"))]
    if left:
        notes.append("roles not drawn: " + ", ".join(left[:12])
                     + (", ..." if len(left) > 12 else "")
                     + " (--roles to choose)")
    return "<ul class='note'>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>"


def page(d, curves: str, heatmaps: list, verdicts: dict, out: Path) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    heat = "".join(f"<h3>{_e(role)}</h3><div class='fig'>{svg}</div>" for role, svg in heatmaps) \
        or "<p>No module statistics to draw.</p>"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>stabilitywatch report: {_e(d.run_dir.name or d.run_dir)}</title>
<style>{CSS}</style></head><body>
<h1>stabilitywatch run report</h1>
<p class="muted"><code>{_e(d.run_dir)}</code>, written {when}</p>
{summary_html(d)}
<h2 id="incidents">Incident timeline</h2>
{timeline_html(d, verdicts, out)}
<h2 id="curves">Loss and gradient norm</h2>
{f"<div class='fig'>{curves}</div>" if curves else "<p>No loss or gradient-norm records.</p>"}
<h2 id="heatmaps">Module &times; step heatmaps</h2>
<p class="note">Rows: modules in the order they were first recorded; columns: steps with
statistics. Grey: not read at that step; circles: cells named by a warning or critical alert.
log2 absmax (over finite values): magenta where NaN/Inf are present, orange above the colour
scale (which ends one bit past the 99.5th percentile of the cells when the largest lies more than
3 bits beyond it, likewise at the low end), black where every value is zero. Fractions of
values that would underflow (of the nonzero ones) or overflow (of the finite ones) in the format,
on a log scale; white: none.</p>
{heat}
<h2 id="run">Run</h2>
{run_html(d)}
<h2 id="notes">About this page</h2>
{notes_html(d)}
</body></html>
"""
