"""Host syncs made by stabilitywatch's own code, caught on the CPU: while active, Tensor.item,
tolist, __bool__, numpy and nonzero raise when a stabilitywatch frame is on the stack (on a GPU
each would wait for the device). The training code around it may sync as it likes, and so may
Monitor._process at a step's end: it reads only frames whose copies to host memory have
landed (on a GPU it polls their events and never waits), and so may the frame processing
thread (stabilitywatch/processing.py): it works on those frames, off the training thread."""
import contextlib
import os
import sys
import threading

import torch

from stabilitywatch.processing import THREAD_NAME

NAMES = ("item", "tolist", "__bool__", "numpy", "nonzero")


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    saved = {n: getattr(torch.Tensor, n) for n in NAMES}
    calls = []

    def guard(name):
        def f(*a, **k):
            if threading.current_thread().name == THREAD_NAME:
                return saved[name](*a, **k)
            stack, frame = [], sys._getframe(1)
            while frame is not None:
                stack.append(frame)
                frame = frame.f_back
            if any(f.f_code.co_name == "_process" and f.f_code.co_filename.endswith(
                    f"stabilitywatch{os.sep}monitor.py") for f in stack):
                return saved[name](*a, **k)
            for frame in stack:
                if f"{os.sep}stabilitywatch{os.sep}" in frame.f_code.co_filename:
                    calls.append(f"Tensor.{name} from {frame.f_code.co_filename}:"
                                 f"{frame.f_lineno}")
                    raise AssertionError(f"host sync: {calls[-1]}")
            return saved[name](*a, **k)
        return f
    for n in NAMES:
        monkeypatch.setattr(torch.Tensor, n, guard(n))
    try:
        yield calls
    finally:
        for n in NAMES:
            monkeypatch.setattr(torch.Tensor, n, saved[n])
