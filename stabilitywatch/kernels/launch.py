"""Launch a compiled Triton kernel without Triton's per-call Python work.

`kernel[grid](...)` binds every argument, computes a specialization key from each (tensor
alignment, integer values), hashes it and checks the kernel's globals on every call: ~40-60 us
of host time on the H200's host, paid thousands of times per sampled step. Our launches vary in
few ways that we know (dtype, pointer alignment, the constexprs we pass), so after the first
launch of a specialization its compiled launcher is called directly with the same arguments
Triton would pass (launch hooks included). A launcher that refuses them (another Triton version)
turns this off and every launch goes through Triton again.
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("stabilitywatch")


try:
    from triton import knobs as _knobs
except Exception:  # a Triton without knobs: no launch hooks to pass on
    _knobs = None


def _hooks():
    if _knobs is None:
        return None, None
    runtime = _knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    # Triton 3.6 keeps empty hook chains there: passed as None, the launcher skips them and we
    # skip launch_metadata (a dict of every argument, built on each launch)
    if enter is not None and getattr(enter, "calls", None) == []:
        enter = None
    if leave is not None and getattr(leave, "calls", None) == []:
        leave = None
    return enter, leave


class FastLaunch:
    def __init__(self, fn):
        self.fn = fn
        self.names = list(fn.arg_names)
        self.cache: dict = {}
        self.on = True

    def __call__(self, grid: "int | tuple", args: tuple, constexprs: dict, num_warps: int,
                 **options) -> None:
        """grid: programs (an int, or a tuple of up to 3); args: the kernel's runtime arguments in
        order (tensors, floats, ints) on a CUDA device; constexprs: every constexpr argument by
        name; options: other compile options (maxnreg)."""
        grid = (grid, 1, 1) if isinstance(grid, int) else (tuple(grid) + (1, 1))[:3]
        key = None
        if self.on:
            # Triton loads and launches on the current device (not the tensors'): so do we
            device = torch.cuda.current_device()
            key = (device, num_warps, *_specs(args), *constexprs.items(), *options.items())
            kernel = self.cache.get(key)
            if kernel is not None and self.run(kernel, grid, device,
                                               (*args, *constexprs.values())):
                return
        t0 = time.perf_counter()
        kernel = self.fn[grid](*args, **constexprs, num_warps=num_warps, **options)
        if key is not None:  # the first launch of this specialization (a compile, or a cache load)
            log.debug("stabilitywatch: %s %s first launch %.0f ms",
                      getattr(self.fn, "__name__", self.fn), key, (time.perf_counter() - t0) * 1e3)
        if key is not None and kernel is not None and hasattr(kernel, "run"):
            if list(constexprs) != self.names[len(args):]:
                self.on = False  # arguments not in declaration order: cannot replay them
                return
            self.cache[key] = kernel

    def run(self, kernel, grid: tuple, device: int, full: tuple) -> bool:
        """The call Triton's JITFunction.run ends with; False (and direct launches off) when the
        launcher refuses it."""
        try:
            stream = torch._C._cuda_getCurrentRawStream(device)
            enter, leave = _hooks()
            meta = kernel.launch_metadata(grid, stream, *full) if enter is not None else None
            kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, meta, enter,
                       leave, *full)
            return True
        except Exception as e:  # a launcher that takes other arguments
            self.on = False
            log.warning("stabilitywatch: direct kernel launch failed (%s: %s); using Triton's "
                        "launcher", type(e).__name__, e)
            return False

    def bind(self, constexprs: dict, num_warps: int, **options) -> "Bound":
        """This kernel with these constexprs and options, for launches that repeat them."""
        return Bound(self, constexprs, num_warps, options)


class Bound:
    """FastLaunch with its constexprs and options fixed: a launch looks its kernel up by device
    and the runtime arguments' specialization alone (~11 us of host time less per launch than
    FastLaunch's key of every argument, on the H200's host: benchmarks/diagnose_record.py)."""

    def __init__(self, fast: FastLaunch, constexprs: dict, num_warps: int, options: dict):
        self.fast, self.constexprs, self.num_warps, self.options = (fast, constexprs, num_warps,
                                                                    options)
        self.values = tuple(constexprs.values())
        self.rest = (*constexprs.items(), *options.items())
        self.kernels: dict = {}

    def __call__(self, grid: int, args: tuple) -> None:
        fast = self.fast
        if fast.on:
            device = torch.cuda.current_device()
            specs = (device, *_specs(args))
            kernel = self.kernels.get(specs)
            if kernel is not None and fast.run(kernel, (grid, 1, 1), device,
                                               (*args, *self.values)):
                return
        fast(grid, args, self.constexprs, self.num_warps, **self.options)
        if fast.on:  # FastLaunch kept the kernel: find it again by its own key
            kernel = fast.cache.get((specs[0], self.num_warps, *specs[1:], *self.rest))
            if kernel is not None:
                self.kernels[specs] = kernel


def _specs(args: tuple) -> list:
    # what Triton specializes each runtime argument on: a tensor's dtype and 16-byte alignment;
    # ints are passed to do_not_specialize parameters only, as int32 when they fit, else int64;
    # floats are never specialized. One call for all of them: a launch's host time is a few us
    tensor = torch.Tensor
    return [(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, tensor)
            else (int, -2**31 <= a < 2**31) if isinstance(a, int) else type(a) for a in args]
