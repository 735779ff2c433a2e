"""Choose between the Triton kernel and the pure-torch reference, and flatten inputs."""
from __future__ import annotations

import functools
import os

import numpy as np
import torch

from ..stats import cpu as host
from ..stats.layout import init_row_tensor, merge_into
from ..stats.reference import reference_row


@functools.lru_cache(maxsize=1)
def _triton_module():
    try:
        from . import stats_triton
    except Exception:  # no triton, or a triton that does not import here
        return None
    return stats_triton


def _interpret() -> bool:
    # read per call off CUDA only: tests switch the interpreter on and off around this module
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(device: torch.device, backend: str = "auto") -> bool:
    """True when the kernel should run for tensors on `device`."""
    if backend == "torch":
        return False
    if device.type != "cuda" and not (_interpret() and backend == "triton"):
        return False
    mod = _triton_module()
    if mod is None and backend == "triton":
        raise RuntimeError("stabilitywatch: backend='triton' asked for but triton does not import")
    return mod is not None


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous tensor with the same elements (order is irrelevant to the statistics).

    Contiguous tensors and dense permutations (transposes, channels-last) are viewed in place
    at no cost; only tensors with gaps (strided slices) are copied, which costs one extra read
    and write of the tensor and a temporary of its size.
    """
    # a view with the negative bit set (complex.conj().imag) holds its values un-negated in
    # memory, which the kernels would read as they are: it is copied with the sign applied
    t = t.detach().resolve_neg()
    if t.is_contiguous():
        return t.reshape(-1)
    if _dense(t):
        return t.as_strided((t.numel(),), (1,), t.storage_offset())
    return t.contiguous().view(-1)  # copies (reshape could return a strided 1-D view)


def _flat_of(t: torch.Tensor) -> torch.Tensor:
    # what the kernel launch reads t through: t itself where it is contiguous (the launch
    # reads its elements from the first, whatever its shape), else flat_view(t)
    if t.is_contiguous() and not t.requires_grad and not t.is_neg():
        return t
    return flat_view(t)


def viewable(t: torch.Tensor) -> bool:
    """True when flat_view(t) is a view (it reads t's own memory), not a copy."""
    return not t.is_neg() and (t.is_contiguous() or _dense(t))


def _dense(t: torch.Tensor) -> bool:
    # non-overlapping and dense: sorted by stride, each stride equals the product of the
    # sizes of the dimensions inside it
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _kernel_ok(t: torch.Tensor, backend: str) -> bool:
    mod = _triton_module()
    return (mod is not None and t.dtype in mod.KERNEL_DTYPES
            and triton_usable(t.device, backend))


def accumulate(t: torch.Tensor, row: torch.Tensor, scale: "float | torch.Tensor" = 1.0,
               backend: str = "auto") -> None:
    """Merge the statistics of t into `row` (a float64 device row) without a host sync."""
    if t.is_cuda and backend != "torch":   # the hooks' path: the fewest checks before the launch
        mod = _triton_module()
        if mod is not None and t.dtype in mod.KERNEL_DTYPES:
            if t.numel():
                mod.run_row_stats(_flat_of(t), row, scale, None, None)
            return
    if t.numel() == 0:
        return
    if _kernel_ok(t, backend):
        _triton_module().launch_row_stats(flat_view(t), row, scale)
    elif _host_ok(t, row.device, scale, backend) and row.dtype == torch.float64 \
            and not row.requires_grad:
        host.merge_host(host.host_view(row).reshape(1, -1), host.cpu_rows([t], [host.host_scale(scale)]))
    else:
        merge_into(row, reference_row(t, scale))


_HOST_DTYPES = host.SUPPORTED_DTYPES


def _host_ok(t: torch.Tensor, row_device: torch.device, scale, backend: str) -> bool:
    # the CPU path (stats/cpu.py) for CPU tensors into CPU rows; backend="torch" asks for the
    # reference itself, and code being traced by torch.compile gets torch ops it can trace
    return (backend != "torch" and host.supported(t) and row_device.type == "cpu"
            and (not isinstance(scale, torch.Tensor) or scale.device.type == "cpu")
            and not _compiling())


def _compiling() -> bool:
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(fn and fn())


def host_scale_of(t: torch.Tensor, rows: torch.Tensor, scale, backend: str = "auto"):
    """The scale as the CPU path takes it (a float) when that path reads t into rows (CPU
    tensor and rows, no kernel for it), else None."""
    if backend == "auto" and type(scale) is float and t.device.type == "cpu":
        # the hooks' path on the CPU: "auto" runs no kernel there, and a float scale is on
        # the host (the checks below, for what is left)
        if (t.dtype in _HOST_DTYPES and t.layout == torch.strided and rows.device.type == "cpu"
                and rows.dtype == torch.float64 and not rows.requires_grad
                and not _compiling()):
            return host.host_scale(scale)
        return None
    if (not _kernel_ok(t, backend) and _host_ok(t, rows.device, scale, backend)
            and rows.dtype == torch.float64 and not rows.requires_grad):
        return host.host_scale(scale)
    return None


def accumulate_each(items: list, backend: str = "auto") -> None:
    """accumulate(t, rows[slot], scale, backend) for each (t, rows, slot, scale) of items; the
    CPU tensors among them share the CPU path's passes (small tensors of one dtype and scale
    are read as one) and their rows merge in one go. No host sync on a device."""
    batch: dict = {}
    for t, rows, slot, scale in items:
        if t.numel() == 0:
            continue
        s = host_scale_of(t, rows, scale, backend)
        if s is not None:
            batch.setdefault(id(rows), (rows, []))[1].append((t, slot, s))
        else:
            accumulate(t, rows[slot], scale, backend)
    for rows, todo in batch.values():
        got = host.cpu_rows([t for t, _, _ in todo], [s for _, _, s in todo])
        host.merge_at(host.host_view(rows), np.array([slot for _, slot, _ in todo]), got)


# larger tensors get their own launch (the tile kernel reads them faster); here, not in
# stats_multi, so that the check per tensor needs no import of the Triton module
MULTI_MAX = 1 << 17


def batchable(t: torch.Tensor, scale: "float | torch.Tensor", backend: str = "auto") -> bool:
    """True when t can share a multi-tensor launch (accumulate_many): a kernel dtype on a device
    the kernel runs on, scale 1, at most MULTI_MAX elements."""
    return (not isinstance(scale, torch.Tensor) and scale == 1.0 and 0 < t.numel() <= MULTI_MAX
            and _kernel_ok(t, backend) and _addresses_ok(t))


def tileable(t: torch.Tensor, scale: "float | torch.Tensor", backend: str = "auto") -> bool:
    """True when t, too large for batchable(), can share a multi-tensor launch of the tile
    kernel (kernels/tile_multi.py): float32, bf16 or fp16 on a device the kernel runs on, scale
    1, read in place at a 16-byte aligned address."""
    return (not isinstance(scale, torch.Tensor) and scale == 1.0 and t.numel() > MULTI_MAX
            and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _kernel_ok(t, backend) and _addresses_ok(t) and viewable(t)
            and t.data_ptr() % 16 == 0)


def _addresses_ok(t: torch.Tensor) -> bool:
    # the multi-tensor launches pass tables of addresses: the interpreter, which copies a CUDA
    # tensor argument to the host, would read device addresses from the host
    return not (t.is_cuda and _interpret())


def accumulate_many(ts: list, rows: torch.Tensor, slots: list) -> list:
    """Merge the statistics of each ts[k] into rows[slots[k]]: one launch per dtype for the
    small tensors (and the large ones' tails), one per dtype for the large tensors' full tiles
    (one more for each further tensor of a row already in the launch).
    Every tensor must pass batchable() or tileable(); no host sync. Returns the launches
    (stats_multi.ManyLaunch, tile_multi.TileManyLaunch), each with the tensors it reads as
    (index in ts, first element): they run again on the same tensors (same storage) without host
    work per tensor, or take the new addresses of tensors like them (`rebind`)."""
    from .stats_multi import launch_many
    from .tile_multi import TileManyLaunch, full_tiles
    small: dict = {}
    large: dict = {}
    # a launch never holds two tensors of one row: its programs claim the row's shift without
    # waiting, which needs every program of a launch over a row to propose the same one
    # (row_ops._claim_shift); a row's second tensor goes to a second launch
    seen_small: dict = {}
    seen_large: dict = {}
    for i, (t, s) in enumerate(zip(ts, slots)):
        f = flat_view(t)
        off = 0
        if f.numel() > MULTI_MAX:
            off = full_tiles(f)
            r = seen_large[s] = seen_large.get(s, -1) + 1
            for acc, v in zip(large.setdefault((t.dtype, r), ([], [], [])), (f, s, (i, 0))):
                acc.append(v)
            f = f[off:]
            if f.numel() == 0:
                continue
        r = seen_small[s] = seen_small.get(s, -1) + 1
        for acc, v in zip(small.setdefault((t.dtype, r), ([], [], [], [])),
                          (f, s, (i, off), off * f.element_size())):
            acc.append(v)
    launches = [(launch_many(flats, rows, ss, ko), src) for flats, ss, src, ko in small.values()]
    for flats, ss, src in large.values():
        launch = TileManyLaunch(flats, ss, rows.device)
        launch.run(rows)
        launches.append((launch, src))
    return launches


def compute_row(t: torch.Tensor, scale: "float | torch.Tensor" = 1.0,
                backend: str = "auto") -> torch.Tensor:
    """A new statistics row for t."""
    if t.numel() and not _kernel_ok(t, backend) and _host_ok(t, t.device, scale, backend):
        return torch.from_numpy(host.cpu_row(t, scale))
    row = init_row_tensor(t.device)
    accumulate(t, row, scale, backend)
    return row
