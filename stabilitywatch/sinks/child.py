"""A sink's writer process, seen from the training process.

Formatting and writing a frame of statistics is ~10 ms (JSONL) to ~125 ms (TensorBoard) of
Python per 608-row frame; on the sink's thread it holds the GIL that the training thread takes
back after every PyTorch call (benchmarks/RESULTS.md). The JSONL and TensorBoard sinks hand the
values to a process of their own (jsonl_writer.py, tb_writer.py, both on child_loop.py).

Messages: 4 bytes of length (little-endian) and a pickle. Replies, one line each: "ok", "ready",
or "error ERRNO MESSAGE" (after which the writer exits).
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
from typing import Optional

log = logging.getLogger("stabilitywatch")
HERE = os.path.dirname(os.path.abspath(__file__))


def can_start() -> bool:
    # a frozen application's executable is not a Python that runs scripts
    return bool(sys.executable) and not getattr(sys, "frozen", False)


class Child:
    """A writer process; send() and request() may come from two threads (the sink runner
    delivers an alert on the caller's thread when its worker is stuck)."""

    def __init__(self, argv: list[str], label: str):
        self.label = label
        self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._lock = threading.Lock()

    @classmethod
    def start(cls, argv: list[str], label: str, handshake: bool = False) -> Optional["Child"]:
        """The running writer, or None when no process can be started here (the caller
        writes in-process). handshake: wait for its "ready" line (its imports worked)."""
        if not can_start():
            return None
        try:
            child = cls(argv, label)
            if handshake:
                child.reply("ready")
            return child
        except OSError as e:
            log.info("stabilitywatch: %s not started (%s); the sink's thread writes", label, e)
            return None

    def send(self, *msgs: tuple) -> None:
        data = b"".join(len(d).to_bytes(4, "little") + d for d in
                        (pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in msgs))
        with self._lock:
            try:
                self.proc.stdin.write(data)
                self.proc.stdin.flush()
            except OSError:  # the writer is gone: say why
                self.reply()
                raise

    def request(self, msg: tuple) -> None:
        """Send and wait for "ok" (flush, close)."""
        with self._lock:
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            try:
                self.proc.stdin.write(len(data).to_bytes(4, "little") + data)
                self.proc.stdin.flush()
            finally:
                self.reply()

    def reply(self, want: str = "ok") -> None:
        line = self.proc.stdout.readline().decode(errors="replace").strip()
        if line == want:
            return
        if line.startswith("error "):
            code, _, text = line[6:].partition(" ")
            raise OSError(int(code) or None, text)
        self.proc.wait(timeout=30)
        err = self.proc.stderr.read().decode(errors="replace").strip().splitlines()
        raise OSError(f"{self.label} exited ({self.proc.returncode}): "
                      f"{err[-1] if err else 'no message'}")

    def stop(self) -> None:
        p = self.proc
        for pipe in (p.stdin, p.stdout, p.stderr):
            try:
                pipe.close()
            except OSError:
                pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
