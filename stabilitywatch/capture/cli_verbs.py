"""`stabilitywatch replay CAPTURE ...` and `stabilitywatch inspect CAPTURE`.

Exit statuses: 0 the command ran (the verdict is in the text and the JSON); 2 it could not run
(bad arguments, a missing or tampered bundle, code not named, a model factory or step function
that cannot be imported, returns the wrong thing or raises); with `--fail-on`, 3 when the step
does not reproduce and 4 when a module departs from the reference (3 first when both hold).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable, Optional

EXIT_OK, EXIT_ERROR, EXIT_NOT_REPRODUCED, EXIT_DEPARTS = 0, 2, 3, 4
FAIL_ON = {"not-reproduced": EXIT_NOT_REPRODUCED, "departs": EXIT_DEPARTS}


def _fail_on(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in FAIL_ON]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{', '.join(bad) or repr(text)}: expected "
                                         f"{' or '.join(FAIL_ON)} (comma-separated)")
    return names


def _positive(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number")
    return v


def add_parsers(sub) -> None:
    r = sub.add_parser(
        "replay", help="re-run a captured step: does it reproduce, where does low precision "
                       "depart from fp64, does upcasting help",
        description="Re-run a captured step and explain it. A capture is untrusted: replay "
                    "imports only the model factory and step function you name (or, with "
                    "--trust-recorded, the ones `stabilitywatch inspect` shows).",
        epilog="exit status: 0 the replay ran (the verdict is in the output); 2 it could not "
               "run (bad arguments, bundle or code); with --fail-on: 3 the step does not "
               "reproduce, 4 a module departs from the reference (3 first).")
    r.add_argument("capture", metavar="CAPTURE", help="a capture bundle directory")
    r.add_argument("--model-factory", metavar="PKG.MOD:FN", dest="model_factory", default=None,
                   help="the model factory, model_factory() -> nn.Module (modules in the "
                        "current directory are found)")
    r.add_argument("--model", dest="model_factory", default=None, help=argparse.SUPPRESS)
    r.add_argument("--step-fn", metavar="PKG.MOD:FN", default=None,
                   help="the step function, step_fn(model, batch) -> loss")
    r.add_argument("--trust-recorded", action="store_true",
                   help="run the model factory and step function recorded in the capture for "
                        "those not given (see them first with `stabilitywatch inspect`)")
    r.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:1... (default: the recorded device type if present)")
    r.add_argument("--json", metavar="FILE", default=None,
                   help="also write the report as JSON to FILE ('-': stdout, instead of text)")
    r.add_argument("--upcast", metavar="GLOB", action="append", default=[],
                   help="what-if: re-run with modules matching GLOB in fp32 (repeatable)")
    r.add_argument("--reference", choices=("fp64", "fp32"), default="fp64",
                   help="precision of the reference replay (default fp64)")
    r.add_argument("--tol", type=_positive, default=0.1,
                   help="relative L2 error above which a module diverges (default 0.1)")
    r.add_argument("--compute-only", action="store_true",
                   help="judge modules as computed, without the round trip through the format "
                        "of Config.formats")
    r.add_argument("--fail-on", metavar="WHAT", type=_fail_on, action="extend", default=[],
                   help="exit 3 when the step does not reproduce (not-reproduced), 4 when a "
                        "module departs from the reference (departs); comma-separated or "
                        "repeated")
    r.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    i = sub.add_parser("inspect", help="summarise a capture bundle (verifies its checksums; "
                                       "imports and runs nothing)")
    i.add_argument("capture", metavar="CAPTURE", help="a capture bundle directory")
    i.add_argument("--json", metavar="FILE", default=None,
                   help="write the manifest (verified) to FILE ('-': stdout)")
    i.add_argument("--no-progress", action="store_true",
                   help="no progress line on stderr (in a log: only when verifying takes "
                        "longer than 1 s)")


def run(args: argparse.Namespace, watch: Optional[Callable] = None) -> int:
    """The exit status (see the module docstring); errors are one line on stderr. `watch`: the
    monitor replay re-runs the step under (stabilitywatch.watch)."""
    try:
        if args.cmd == "inspect":
            return _inspect(args)
        return _replay(args, watch)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:  # bundle errors, and whatever the user's model code raises
        from .report import printable

        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        kind = "" if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: "
        print(printable(f"stabilitywatch {args.cmd}: error: {kind}{msg}"), file=sys.stderr)
        return EXIT_ERROR


def _inspect(args: argparse.Namespace) -> int:
    from .reader import open_capture
    from .report import Progress, inspect_text

    bar = Progress(total=1, name="inspect", enabled=not args.no_progress)
    try:
        bar.phase("verifying checksums")
        cap = open_capture(args.capture, progress=bar.amount)
    finally:
        bar.close()
    if args.json == "-":
        print(json.dumps(cap.manifest, indent=1))
        return EXIT_OK
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cap.manifest, f, indent=1)
    print(inspect_text(cap))
    return EXIT_OK


def _replay(args: argparse.Namespace, watch: Optional[Callable]) -> int:
    from .replay import replay
    from .report import replay_text

    to_stdout = args.json == "-"
    if args.json and not to_stdout:
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent) or os.path.isdir(args.json):
            raise ValueError(f"--json {args.json!r}: cannot write there (no such directory, or "
                             f"a directory)")
    # like `python -m stabilitywatch`, find the user's modules in the working directory; it is
    # searched last, so a file there cannot stand in for an installed module
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    report = replay(args.capture, model_factory=args.model_factory, step_fn=args.step_fn,
                    trust_recorded=args.trust_recorded, device=args.device, upcast=args.upcast,
                    reference=args.reference, tol=args.tol,
                    emulate_formats=not args.compute_only, progress=not args.no_progress,
                    json_file=None if to_stdout else args.json, watch=watch)
    print(json.dumps(report, indent=1) if to_stdout else replay_text(report))
    if "not-reproduced" in args.fail_on and not report["reproduces"]:
        return EXIT_NOT_REPRODUCED
    if "departs" in args.fail_on and report["first_divergent_module"] is not None:
        return EXIT_DEPARTS
    return EXIT_OK
