"""Small CPU tensors of a step, read together: their values are copied as they come (a hook's
tensor may change in place after the hook) and their rows computed in one set of passes when
the rows are next needed (stats/cpu.py), instead of ~70 numpy calls for each tensor."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .cpu import CHUNK, SMALL, _rows, _scratch, _shift, _work_of, host_view, merge_at

_F64 = torch.float64
# dtypes torch.cat widens exactly into the held float32 (float64) arrays
_CAT = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})


class HostStage:
    """Copies of small CPU tensors waiting for their rows: (device, slot) -> merged at flush."""

    def __init__(self):
        self._bufs: dict = {}      # (work dtype is float64, scale) -> float array of CHUNK
        self._todo: dict = {}      # same key -> [(device, slot, start, n)]
        self._fill: dict = {}      # same key -> values held

    def put(self, t: torch.Tensor, slot: int, scale: float, rows_of) -> bool:
        """Hold t's values for row `slot`; False (nothing held) for a tensor too large to gain
        from it. rows_of: device -> rows tensor, for a flush when the stage is full."""
        n = t.numel()
        if not 0 < n <= SMALL:
            return False
        key = (t.dtype == _F64, scale)
        used = self._fill.get(key, 0)
        if used + n > CHUNK:
            self.flush(rows_of)
            used = 0
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = np.empty(CHUNK, dtype=np.float64 if key[0] else np.float32)
        src = t.detach().resolve_neg()
        torch.from_numpy(buf[used: used + n]).view(src.shape).copy_(src)
        self._todo.setdefault(key, []).append((t.device, slot, used, n))
        self._fill[key] = used + n
        return True

    def put_many(self, items: list, rows_of) -> list:
        """put() for each (t, slot, scale) of items, the tensors of one scale and work dtype
        copied in one call (torch.cat into the held array). Returns the indices of the items not
        held (too large, empty, or of a dtype cat does not widen)."""
        rest = []
        run: list = []          # (t, slot, n) of the next copy, all of key `key`
        key, used = None, 0
        for i, (t, slot, scale) in enumerate(items):
            n = t.numel()
            if not 0 < n <= SMALL or t.dtype not in _CAT:
                rest.append(i)
                continue
            k = (t.dtype == _F64, scale)
            if k != key or used + n > CHUNK:
                self._put_run(key, run, rows_of)
                run, key = [], k
                used = self._fill.get(k, 0)
                if used + n > CHUNK:
                    self.flush(rows_of)
                    used = 0
            run.append((t, slot, n))
            used += n
        self._put_run(key, run, rows_of)
        return rest

    def _put_run(self, key, run: list, rows_of) -> None:
        if not run:
            return
        used = self._fill.get(key, 0)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = np.empty(CHUNK, dtype=np.float64 if key[0] else np.float32)
        total = sum(n for _, _, n in run)
        torch.cat([t.detach().resolve_neg().reshape(-1) for t, _, _ in run],
                  out=torch.from_numpy(buf[used: used + total]))
        todo = self._todo.setdefault(key, [])
        for t, slot, n in run:
            todo.append((t.device, slot, used, n))
            used += n
        self._fill[key] = used

    @property
    def held(self) -> bool:
        return bool(self._todo)

    def slots(self) -> set:
        return {slot for todo in self._todo.values() for _, slot, _, _ in todo}

    def clear(self) -> None:
        self._todo.clear()
        self._fill.clear()

    def flush(self, rows_of) -> None:
        """Merge the rows of every held tensor into rows_of(device)[slot]."""
        todo, fill = self._todo, self._fill
        self._todo, self._fill = {}, {}
        for key, items in todo.items():
            w = _work_of(_F64 if key[0] else torch.float32)
            x = self._bufs[key][: fill[key]]
            starts = np.array([start for _, _, start, _ in items], dtype=np.int64)
            with np.errstate(all="ignore"):
                got = _rows(x, starts, _shift(x[starts]), key[1], w, _scratch(w))
            by_dev: dict = {}
            for k, (device, slot, _, _) in enumerate(items):
                by_dev.setdefault(device, ([], []))
                by_dev[device][0].append(slot)
                by_dev[device][1].append(k)
            for device, (slots, ks) in by_dev.items():
                rows: Optional[torch.Tensor] = rows_of(device)
                merge_at(host_view(rows), np.array(slots), got[ks])
