"""`stabilitywatch report RUN_DIR`: one self-contained HTML page about a run directory.

The page holds the incident timeline (alerts.jsonl, grouped by incident, root first, with links
to capture bundles and the replay verdicts found beside them: see replays.py for where), the loss
and global gradient-norm curves, module x step heatmaps of log2 absmax and of the underflow and
overflow fractions per role, and the run's config and versions (run.json). Figures are
matplotlib SVG inlined into the page: it opens without a network.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from .load import DEFAULT_ROLES, FORMATS, load_run
from .replays import bundle_path, find_verdicts

__all__ = ["write_report", "DEFAULT_ROLES", "FORMATS", "MissingDependency"]

DEFAULT_NAME = "report.html"


class MissingDependency(RuntimeError):
    """matplotlib is not installed."""


def write_report(run_dir, out=None, roles: Optional[Sequence[str]] = None,
                 formats: Optional[Sequence[str]] = None, max_modules: int = 60,
                 max_steps: int = 240) -> Path:
    """Write the report of `run_dir` to `out` (a file, or a directory to hold report.html;
    default RUN_DIR/report.html) and return its path. ValueError/OSError for a bad path."""
    from . import figures, page

    if not figures.available():
        raise MissingDependency("stabilitywatch report needs matplotlib: "
                                "pip install 'stabilitywatch[report]'")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir}: not a run directory (no such directory)")
    bad = [f for f in formats or () if f not in FORMATS]
    if bad:
        raise ValueError(f"--formats: unknown format {bad[0]!r} (known: {', '.join(FORMATS)})")
    if max_modules < 1 or max_steps < 2:
        raise ValueError("need --max-modules >= 1 and --max-steps >= 2")
    out = Path(out) if out is not None else run_dir / DEFAULT_NAME
    if out.is_dir():
        out = out / DEFAULT_NAME
    d = load_run(run_dir, roles=list(roles) if roles else None,
                 formats=list(formats) if formats else None,
                 max_modules=max_modules, max_steps=max_steps)
    if not (d.manifest or d.alerts or d.stats_files):
        raise ValueError(f"{run_dir}: not a run directory (no run.json, alerts.jsonl or "
                         "stats.jsonl)")
    bundles = sorted({b for a in d.alerts if (b := bundle_path(run_dir, a.get("capture")))})
    verdicts = find_verdicts(run_dir, bundles)
    curves = figures.curves_svg(d.loss, d.grad_norm, d.alerts) if (d.loss or d.grad_norm) else ""
    heatmaps = []
    for role, g in d.grids.items():
        if not g.modules or not d.columns:
            continue
        heatmaps.append((role, figures.heatmap_svg(g, d.columns, d.step_bin, d.formats[role],
                                                   _marks(d, g))))
    text = page.page(d, curves, heatmaps, verdicts, out.resolve())
    tmp = out.with_name(f".{out.name}.tmp")   # a page is complete or absent
    try:
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(out)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return out


def _marks(d, g) -> list[tuple[int, int]]:
    """(column, row) of the cells that warning/critical alerts name for this role."""
    rows = {m: i for i, m in enumerate(g.modules)}
    out = set()
    for a in d.alerts:
        if a.get("severity") not in ("warning", "critical") or a.get("tensor") != g.role:
            continue
        step = a.get("step")
        r, c = rows.get(a.get("module")), d.col_of.get(step) if isinstance(step, int) else None
        if r is not None and c is not None:
            out.add((c, r))
    return sorted(out)
