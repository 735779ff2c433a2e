"""The writer processes' side of sinks/child.py (standard library only: jsonl_writer.py runs
under `python -I`, without the package).

serve(handle, sync, close, report=None): reads messages from stdin; ("flush",) and ("close",)
call sync() (and close()) and answer "ok", or "ok REPORT" with report() (what the writer has
written so far, say); any other message goes to handle(msg). End of input (the training process
is gone): sync, close, exit 0. An OSError or a bad message: "note REPORT" (with report), then one
"error ERRNO MESSAGE" line, exit 1.
"""
from __future__ import annotations

import pickle
import sys


def say(line: str) -> None:
    sys.stdout.buffer.write(line.encode() + b"\n")
    sys.stdout.buffer.flush()


def serve(handle, sync, close, report=None) -> int:
    inp = sys.stdin.buffer
    tail = (lambda: " " + report()) if report is not None else (lambda: "")
    try:
        while True:
            head = inp.read(4)
            if len(head) < 4:  # the training process is gone: keep what came
                sync()
                close()
                return 0
            msg = pickle.loads(inp.read(int.from_bytes(head, "little")))
            if msg[0] in ("flush", "close"):  # durable, then say so
                sync()
                if msg[0] == "close":
                    close()
                say("ok" + tail())
                if msg[0] == "close":
                    return 0
            else:
                handle(msg)
    except OSError as e:
        _note(report)
        say(f"error {e.errno or 0} {e.strerror or e}")
    except Exception as e:  # a bad message: say what, and stop
        _note(report)
        say(f"error 0 {type(e).__name__}: {e}")
    return 1


def _note(report) -> None:
    if report is not None:
        say("note " + report())
