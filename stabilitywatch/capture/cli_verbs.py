"""`stabilitywatch replay CAPTURE ...` and `stabilitywatch inspect CAPTURE`."""
from __future__ import annotations

import argparse
import json
import sys


def add_parsers(sub) -> None:
    r = sub.add_parser("replay", help="re-run a captured step: does it reproduce, where does "
                                      "low precision depart from fp64, does upcasting help",
                       description="Re-run a captured step and explain it.")
    r.add_argument("capture", metavar="CAPTURE", help="a capture bundle directory")
    r.add_argument("--model", metavar="PKG.MOD:FACTORY", default=None,
                   help="model factory (default: the one recorded in the capture)")
    r.add_argument("--step-fn", metavar="PKG.MOD:FN", default=None,
                   help="step function step_fn(model, batch) -> loss (default: recorded)")
    r.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:1... (default: the recorded device type if present)")
    r.add_argument("--json", metavar="FILE", default=None,
                   help="also write the report as JSON to FILE ('-': stdout, instead of text)")
    r.add_argument("--upcast", metavar="GLOB", action="append", default=[],
                   help="what-if: re-run with modules matching GLOB in fp32 (repeatable)")
    r.add_argument("--reference", choices=("fp64", "fp32"), default="fp64",
                   help="precision of the reference replay (default fp64)")
    r.add_argument("--tol", type=float, default=0.1,
                   help="relative L2 error above which a module diverges (default 0.1)")
    r.add_argument("--compute-only", action="store_true",
                   help="judge modules as computed, without the round trip through the format "
                        "of Config.formats")
    r.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    i = sub.add_parser("inspect", help="summarise a capture bundle (verifies its checksums)")
    i.add_argument("capture", metavar="CAPTURE", help="a capture bundle directory")
    i.add_argument("--json", metavar="FILE", default=None,
                   help="write the manifest (verified) to FILE ('-': stdout)")


def run(args: argparse.Namespace) -> int:
    """Exit status 0 when the command completed; errors are one line on stderr and status 2."""
    from .reader import open_capture
    from .replay import replay
    from .report import inspect_text, replay_text

    try:
        if args.cmd == "inspect":
            cap = open_capture(args.capture)
            if args.json == "-":
                print(json.dumps(cap.manifest, indent=1))
            else:
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(cap.manifest, f, indent=1)
                print(inspect_text(cap))
            return 0
        to_stdout = args.json == "-"
        report = replay(args.capture, model_factory=args.model, step_fn=args.step_fn,
                        device=args.device, upcast=args.upcast, reference=args.reference,
                        tol=args.tol, emulate_formats=not args.compute_only,
                        progress=not args.no_progress,
                        json_file=None if to_stdout else args.json)
        print(json.dumps(report, indent=1) if to_stdout else replay_text(report))
        return 0
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # bundle errors, and whatever the user's model code raises
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        kind = "" if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: "
        print(f"stabilitywatch {args.cmd}: error: {kind}{msg}", file=sys.stderr)
        return 2
