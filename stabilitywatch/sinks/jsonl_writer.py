"""The JSONL sink's writer process: `python -I jsonl_writer.py STATS_PATH`.

Formatting a frame's ~21,000 floats takes ~10 ms of CPU; on the sink's thread it would hold the
GIL that every PyTorch call of the training thread takes back (benchmarks/RESULTS.md, "Host
time per processed frame, and the sinks").
Here it runs in its own process, which imports nothing but the standard library and the modules
beside it (jsonl_lines.py, line_file.py, child_loop.py; not the package, not torch).

Messages (child_loop.py): ("lines", parts) | ("flush",) | ("close",). Its reports ("ok N",
"note N" before an error) give N, the records written so far. A write that fails (a full disk)
is cut back to the last complete line (line_file.py) before the writer says so and exits.
"""
from __future__ import annotations

import os
import sys

# this directory last: Python put it first (a script's own), where its modules (base.py,
# runner.py, ...) would shadow any library's of the same name
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [_HERE]
import child_loop  # noqa: E402
import jsonl_lines  # noqa: E402
import line_file  # noqa: E402


def main(path: str) -> int:
    try:
        f = line_file.LineFile(path)
    except OSError as e:
        child_loop.say("note 0")
        child_loop.say(f"error {e.errno or 0} {e.strerror or e}")
        return 1
    written = [0]

    def handle(msg):
        if msg[0] != "lines":
            raise ValueError(f"unknown message {msg[0]!r}")
        f.append(jsonl_lines.encode_parts(msg[1]).encode("utf-8"))
        written[0] += jsonl_lines.count_records(msg[1])

    return child_loop.serve(handle, f.sync, f.close, report=lambda: str(written[0]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
