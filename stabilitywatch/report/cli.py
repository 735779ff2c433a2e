"""`stabilitywatch report RUN_DIR [--out FILE]`."""
from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    r = sub.add_parser("report", help="write a self-contained HTML report of a run directory",
                       description="Write one self-contained HTML file (no network needed to "
                                   "open it) about a run: incident timeline with capture links "
                                   "and replay verdicts, loss and gradient-norm curves, module x "
                                   "step heatmaps, config and versions.")
    r.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds run.json, "
                                                      "alerts.jsonl, stats.jsonl)")
    r.add_argument("--out", metavar="FILE", default=None,
                   help="where to write the page (default RUN_DIR/report.html)")
    r.add_argument("--roles", metavar="R,R", default=None,
                   help="roles to draw heatmaps for (default output,grad_output,weight,grad)")
    r.add_argument("--formats", metavar="F,F", default=None,
                   help="formats of the underflow/overflow heatmaps, e4m3,e5m2,fp16 (default: "
                        "the role's format in Config.formats, else fp16)")
    r.add_argument("--max-modules", type=int, default=60, metavar="N",
                   help="rows per heatmap (default 60)")
    r.add_argument("--max-steps", type=int, default=240, metavar="N",
                   help="columns per heatmap (default 240); more steps share a column")


def _list(s):
    return [x.strip() for x in s.split(",") if x.strip()] if s else None


def run(args: argparse.Namespace) -> int:
    """0 when the page was written; a one-line error and 2 otherwise."""
    from . import MissingDependency, write_report

    try:
        out = write_report(args.run_dir, out=args.out, roles=_list(args.roles),
                           formats=_list(args.formats), max_modules=args.max_modules,
                           max_steps=args.max_steps)
    except MissingDependency as e:
        print(str(e), file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"stabilitywatch report: error: {msg}", file=sys.stderr)
        return 2
    print(f"report: {out}")
    return 0
