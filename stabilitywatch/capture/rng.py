"""The RNG states a bundle replays its step with, read at every step start (state.py's ring,
snapshot.py's slots): Python's, NumPy's global generator, torch's CPU generator and each CUDA
device's default generator (only once CUDA is in use: reading it would start a context)."""
from __future__ import annotations

import ctypes
import random
from typing import Optional

import numpy as np
import torch

# NumPy's MT19937 state struct: 624 uint32 words and the int position
_MT_BYTES = 624 * 4 + 4


class RngStates:
    """Reads the states, NumPy's in full only when it can have changed: a full read of the
    legacy global generator costs ~30 us (its 624-word key is copied word by word), the raw
    words ~1 us. Unchanged words give the same state as the last full read, unless that read
    held a cached Gaussian (`has_gauss`, which a draw takes without moving the words): then it
    is read again. The one state this cannot tell apart is one restored by np.random.set_state
    that has the current words and a cached Gaussian the current state lacks."""

    def __init__(self):
        self._np_words: Optional[bytes] = None
        self._np_state: Optional[tuple] = None

    def read(self) -> dict:
        st = {"python": random.getstate(), "numpy": self._numpy(), "torch": torch.get_rng_state()}
        if torch.cuda.is_initialized():
            # torch.cuda.get_rng_state_all()'s tensors, without its per-device lookups
            st["cuda"] = [g.get_state() for g in torch.cuda.default_generators]
        return st

    def _numpy(self) -> tuple:
        words = _mt_words()
        last = self._np_state
        if words is not None and words == self._np_words and last is not None and not last[3]:
            return last
        self._np_words, self._np_state = words, np.random.get_state()
        return self._np_state


def _mt_words() -> Optional[bytes]:
    """The raw state of NumPy's global generator, or None where it cannot be read so."""
    try:
        bg = np.random.mtrand._rand._bit_generator
        if type(bg).__name__ != "MT19937":
            return None
        return ctypes.string_at(bg.ctypes.state_address, _MT_BYTES)
    except Exception:   # another NumPy layout: every read is a full one
        return None
