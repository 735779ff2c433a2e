"""A sink's writer process, seen from the training process.

Formatting and writing a frame of statistics is ~10 ms (JSONL) to ~125 ms (TensorBoard) of
Python per 608-row frame; on the sink's thread it holds the GIL that the training thread takes
back after every PyTorch call (benchmarks/RESULTS.md, "Host time per processed frame, and the
sinks"). The JSONL and TensorBoard sinks hand the
values to a process of their own (jsonl_writer.py, tb_writer.py, both on child_loop.py).

Messages: 4 bytes of length (little-endian) and a pickle. Replies, one line each: "ok" (or
"ok REPORT"), "ready", or "error ERRNO MESSAGE" (after which the writer exits), which a line
"note REPORT" may precede (the last report is kept in Child.report).
"""
from __future__ import annotations

import errno
import logging
import os
import pickle
import select
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

log = logging.getLogger("stabilitywatch")
HERE = os.path.dirname(os.path.abspath(__file__))


def can_start() -> bool:
    # a frozen application's executable is not a Python that runs scripts
    return bool(sys.executable) and not getattr(sys, "frozen", False)


class Child:
    """A writer process. A lock orders send() and request(), should two threads use one writer;
    send(block=False) gives up instead of waiting for it."""

    timeout = 120.0   # seconds a reply may take before the writer counts as hung
    # seconds the writer may take no input before it counts as hung: below the sink runner's
    # timeout (Config.sinks.timeout, 10 s), so that a stuck writer costs the sink its statistics,
    # not its alerts
    send_timeout = 5.0

    def __init__(self, argv: list[str], label: str):
        self.label = label
        # stderr to a file: a pipe nobody reads would stall a writer that prints warnings
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._err)
        self._lock = threading.Lock()
        self._buf = b""
        self.report: Optional[str] = None   # the writer's last "ok REPORT" or "note REPORT"
        self._nonblocking = _nonblocking_pipe(self.proc.stdin.fileno())

    @classmethod
    def start(cls, argv: list[str], label: str, handshake: bool = False) -> Optional["Child"]:
        """The running writer, or None when no process can be started here or it says it
        cannot work (the caller writes in-process). handshake: wait for its "ready" line."""
        if not can_start():
            return None
        child = None
        try:
            child = cls(argv, label)
            if handshake:
                child.reply("ready")
            return child
        except (OSError, subprocess.SubprocessError) as e:
            if child is not None:
                child.stop(kill=True)
            log.info("stabilitywatch: %s not started (%s); the sink's thread writes", label, e)
            return None

    def send(self, *msgs: tuple, block: bool = True) -> bool:
        """Queue messages for the writer; False (nothing sent) when block is False and another
        thread is sending."""
        data = b"".join(len(d).to_bytes(4, "little") + d for d in
                        (pickle.dumps(m, protocol=pickle.HIGHEST_PROTOCOL) for m in msgs))
        if not self._lock.acquire(blocking=block):
            return False
        try:
            self._write(data)
        except TimeoutError:
            raise
        except OSError:  # the writer is gone: say why
            self.reply()
            raise
        finally:
            self._lock.release()
        return True

    def request(self, msg: tuple) -> Optional[str]:
        """Send and wait for "ok" (flush, close); returns the REPORT of "ok REPORT", if any."""
        with self._lock:
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            try:
                self._write(len(data).to_bytes(4, "little") + data)
            except TimeoutError:
                raise
            except OSError:  # the writer is gone: say why
                self.reply()
                raise
            return self.reply()

    def reply(self, want: str = "ok") -> Optional[str]:
        while True:
            line = self._line()
            if line is None:
                self.stop(kill=True)
                raise OSError(f"{self.label} did not answer within {self.timeout:.0f} s")
            if not line.startswith("note "):
                break
            self.report = line[5:]
        if line == want or line.startswith(want + " "):
            if line != want:
                self.report = line[len(want) + 1:]
                return self.report
            return None
        if line.startswith("error "):
            code, _, text = line[6:].partition(" ")
            raise OSError(int(code) or None, text)
        if line:  # alive, saying something else: not a writer we can talk to
            self.stop(kill=True)
            raise OSError(f"{self.label} said {line[:200]!r}")
        try:  # end of output: it exited, or is exiting
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.stop(kill=True)
        raise OSError(f"{self.label} exited ({self.proc.returncode}): {self._last_error()}")

    def _write(self, data: bytes) -> None:
        """All of data into the writer's pipe. TimeoutError (the writer stopped and killed: a
        message may be cut) when it takes no input for send_timeout seconds."""
        if not self._nonblocking:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
            return
        fd, view = self.proc.stdin.fileno(), memoryview(data)
        moved = time.monotonic()
        while len(view):
            try:
                n = os.write(fd, view)
            except BlockingIOError:
                n = 0
            if n:
                view, moved = view[n:], time.monotonic()
                continue
            left = moved + self.send_timeout - time.monotonic()
            if left <= 0:
                self.stop(kill=True)
                raise TimeoutError(errno.ETIMEDOUT, f"{self.label} took no input for "
                                                    f"{self.send_timeout:g} s")
            select.select([], [fd], [], left)

    def _line(self) -> Optional[str]:
        """The next line from the writer ("" at the end of its output), None after timeout
        seconds. Read with os.read into a buffer of our own: a buffered reader may hold a second
        line that select() cannot see."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + self.timeout
        while b"\n" not in self._buf:
            try:
                ready = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]
            except (OSError, ValueError):  # no select on this pipe (not POSIX): read and wait
                ready = [fd]
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                line, self._buf = self._buf, b""
                return line.decode(errors="replace").strip()
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace").strip()

    def _last_error(self) -> str:
        try:
            self._err.seek(0)
            err = self._err.read().decode(errors="replace").strip().splitlines()
        except (OSError, ValueError):
            err = []
        return err[-1] if err else "no message"

    def stop(self, kill: bool = False) -> None:
        p = self.proc
        if kill and p.poll() is None:
            p.kill()
        for f in (p.stdin, p.stdout):
            try:
                f.close()
            except OSError:
                pass
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        try:
            self._err.close()
        except OSError:
            pass


def _nonblocking_pipe(fd: int) -> bool:
    """A pipe to the writer that holds a whole frame (1 MiB where Linux allows it), written
    without blocking: True when that worked (else writes block, as on a plain pipe)."""
    try:
        import fcntl
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, 1 << 20)
    except (ImportError, AttributeError, OSError):
        pass
    try:
        os.set_blocking(fd, False)
        return True
    except (AttributeError, OSError):
        return False
