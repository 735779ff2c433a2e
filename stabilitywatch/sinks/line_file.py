"""A file of JSON lines that always parses: every append writes whole lines or nothing.

Standard library only: the JSONL sink's writer process (jsonl_writer.py) imports it alone.

- Opening it cuts a last line left unfinished (a writer killed mid-line) back to the last
  complete line: half a JSON object is garbage, and a reader would stop there.
- An append that fails (a full disk: ENOSPC, EDQUOT, EFBIG; or any other OSError) is undone by
  truncating back to the size before it, so the file never ends on a cut line.
- reserve(n): keeps n bytes allocated past the end of the file (fallocate with KEEP_SIZE, Linux;
  a no-op elsewhere). The alerts file holds such a reserve, so that alerts can still be written
  after statistics filled the disk. close() gives the reserve back.
"""
from __future__ import annotations

import errno
import os
from typing import Optional

# the errors of a full disk, quota or file-size limit (RLIMIT_FSIZE)
FULL = frozenset(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None), errno.EFBIG)
                 if e is not None)

_FALLOC_FL_KEEP_SIZE = 1
_fallocate = None


def _load_fallocate():
    global _fallocate
    if _fallocate is None:
        _fallocate = False
        try:
            import ctypes
            f = ctypes.CDLL(None, use_errno=True).fallocate
            f.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            f.restype = ctypes.c_int
            _fallocate = f
        except (ImportError, OSError, AttributeError):  # not Linux (or no ctypes): no reserve
            pass
    return _fallocate


class LineFile:
    def __init__(self, path: str, reserve: int = 0):
        self.path = path
        self.fd: Optional[int] = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT |
                                         getattr(os, "O_CLOEXEC", 0), 0o666)
        self._reserved_to = 0
        self._reserve = int(reserve)
        try:
            self.size = repair_fd(self.fd)
        except OSError:
            os.close(self.fd)
            raise
        if self._reserve:
            self._keep_reserve()

    def append(self, data: bytes, sync: bool = False) -> None:
        """Write data (whole lines) at the end; fsync when sync. On any OSError the file is cut
        back to its size before the call and the error raised."""
        view, done = memoryview(data), 0
        try:
            while done < len(view):
                n = self._write(view[done:])
                if n <= 0:
                    raise OSError(errno.EIO, "write returned 0")
                done += n
            if sync:
                os.fsync(self.fd)
        except OSError:
            self._cut()
            raise
        self.size += len(view)
        if self._reserve and self.size + self._reserve // 2 > self._reserved_to:
            self._keep_reserve()

    def _write(self, data: memoryview) -> int:
        return os.write(self.fd, data)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        try:
            if self._reserved_to > self.size:
                _ftruncate_quietly(fd, self.size)   # gives back the blocks past the end
        finally:
            os.close(fd)

    def _cut(self) -> None:
        _ftruncate_quietly(self.fd, self.size)

    def _keep_reserve(self) -> None:
        f = _load_fallocate()
        if f and f(self.fd, _FALLOC_FL_KEEP_SIZE, self.size, self._reserve) == 0:
            self._reserved_to = self.size + self._reserve


def _ftruncate_quietly(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError:  # not a regular file (/dev/full, a pipe): nothing to cut
        pass


def repair_fd(fd: int) -> int:
    """Cut an unfinished last line; returns the size of the complete lines."""
    try:
        size = os.fstat(fd).st_size
    except OSError:
        return 0
    good, pos = 0, size
    while pos > 0:
        n = min(1 << 16, pos)
        pos -= n
        i = os.pread(fd, n, pos).rfind(b"\n")
        if i >= 0:
            good = pos + i + 1
            break
    if good < size:
        os.ftruncate(fd, good)
    return good


def repair(path: str) -> None:
    """repair_fd on a path (after a writer died); quiet when the file is not there."""
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return
    try:
        repair_fd(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
