"""Command line: `stabilitywatch demo | replay | inspect`, `--version`. Errors are one line and a
non-zero exit (capture/cli_verbs.py lists replay's exit statuses)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Optional, Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stabilitywatch",
                                description="Mixed-precision numerical stability monitor.")
    from . import __version__
    p.add_argument("--version", action="version", version=f"stabilitywatch {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a small model with an injected fault and watch it")
    d.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    d.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="default: cuda when available, else cpu")
    d.add_argument("--steps", type=int, default=40)
    d.add_argument("--fault-step", type=int, default=25)
    d.add_argument("--no-monitor", action="store_true",
                   help="run the same training without the monitor (for overhead timing)")
    from .capture.cli_verbs import add_parsers as add_capture_parsers
    add_capture_parsers(sub)  # replay, inspect
    from .report.cli import add_parser as add_report_parser
    add_report_parser(sub)
    return p


def _demo(args) -> int:
    import torch

    from .demo import run_demo, summary

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("stabilitywatch demo: --device cuda asked for, but no CUDA device is visible")
    if args.steps < 1 or not 0 <= args.fault_step < args.steps:
        raise SystemExit("stabilitywatch demo: need --steps >= 1 and 0 <= --fault-step < --steps")
    out = Path(args.out)
    try:  # the demo exists to write its run directory: refuse one that cannot be written
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SystemExit(f"stabilitywatch demo: cannot write to --out {args.out!r}: "
                         f"{e.strerror or e}")
    r = run_demo(out, device=args.device, steps=args.steps, fault_step=args.fault_step,
                 monitor=not args.no_monitor, baseline=not args.no_monitor)
    print(summary(r))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "demo":
            return _demo(args)
        if args.cmd in ("replay", "inspect"):
            from .capture.cli_verbs import run as run_capture_verb
            from .monitor import watch
            return run_capture_verb(args, watch)
        if args.cmd == "report":
            from .report.cli import run as run_report
            return run_report(args)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    except (ValueError, TypeError, OSError) as e:
        print(f"stabilitywatch: error: {e}", file=sys.stderr)
        return 2
    return 2
