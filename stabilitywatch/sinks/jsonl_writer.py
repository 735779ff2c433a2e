"""The JSONL sink's writer process: `python -I jsonl_writer.py STATS_PATH`.

Formatting a frame's ~21,000 floats takes ~10 ms of CPU; on the sink's thread it held the GIL
that every PyTorch call of the training thread takes back (benchmarks/RESULTS.md, session 3).
Here it runs in its own process, which imports nothing but the standard library and
jsonl_lines.py beside it (not the package, not torch).

Reads from stdin messages of 4 bytes of length (little-endian) and a pickle of
("lines", parts) | ("flush",) | ("close",), from the training process (its own pipe); writes
"ok" or "error ERRNO MESSAGE" lines to stdout for flush and close, and after an error exits.
End of input: flush and exit.
"""
from __future__ import annotations

import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jsonl_lines  # noqa: E402


def main(path: str) -> int:
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    try:
        f = open(path, "a", encoding="utf-8")
        while True:
            head = inp.read(4)
            if len(head) < 4:  # the training process is gone: keep what came
                f.flush()
                return 0
            msg = pickle.loads(inp.read(int.from_bytes(head, "little")))
            if msg[0] == "lines":
                f.write(jsonl_lines.encode_parts(msg[1]))
                f.flush()
            else:  # flush or close: durable, then say so
                f.flush()
                os.fsync(f.fileno())
                out.write(b"ok\n")
                out.flush()
                if msg[0] == "close":
                    f.close()
                    return 0
    except OSError as e:
        out.write(f"error {e.errno or 0} {e.strerror or e}\n".encode())
    except Exception as e:  # a bad message: say what, and stop
        out.write(f"error 0 {type(e).__name__}: {e}\n".encode())
    out.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
