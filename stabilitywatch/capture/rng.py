"""The RNG states a bundle replays its step with, read at every step start (state.py's ring,
snapshot.py's slots): Python's, NumPy's global generator, torch's CPU generator and each CUDA
device's default generator (only once CUDA is in use: reading it would start a context)."""
from __future__ import annotations

import _random
import ctypes
import random
import struct
from typing import Any, Optional

import numpy as np
import torch

# NumPy's MT19937 state struct: 624 uint32 words and the int position; CPython's Random: the
# int position and 624 uint32 words
_MT_BYTES = 624 * 4 + 4


class RngStates:
    """Reads the states, Python's and NumPy's in full only when they can have changed: a full
    read of NumPy's legacy global generator costs ~30 us (its 624-word key is copied word by
    word), of Python's a tuple of 625 ints; their raw words, copied from the generators' own
    memory, ~1 us each. Unchanged words give the same state as the last full read, unless that
    read held a cached Gaussian that can go without moving the words (NumPy's `has_gauss`:
    then it is read again; Python's `gauss_next`: it is compared too). The one state this
    cannot tell apart is one restored by np.random.set_state that has the current words and a
    cached Gaussian the current state lacks. Python's words are read this way only where its
    generator's memory holds them as CPython lays them out (checked against a full read)."""

    def __init__(self):
        self._np_words: Optional[bytes] = None
        self._np_state: Optional[tuple] = None
        self._np_buf: Optional[tuple] = None     # (bit generator, its words in place)
        self._py_src: Optional[tuple] = None     # (random.getstate, its generator, words or None)
        self._py_words: Optional[bytes] = None
        self._py_gauss: Any = None
        self._py_state: Optional[tuple] = None

    def read(self) -> dict:
        st = {"python": self._python(), "numpy": self._numpy(), "torch": torch.get_rng_state()}
        if torch.cuda.is_initialized():
            # torch.cuda.get_rng_state_all()'s tensors, without its per-device lookups
            st["cuda"] = [g.get_state() for g in torch.cuda.default_generators]
        return st

    def _numpy(self) -> tuple:
        words = self._mt_words()
        last = self._np_state
        if words is not None and words == self._np_words and last is not None and not last[3]:
            return last
        self._np_words, self._np_state = words, np.random.get_state()
        return self._np_state

    def _mt_words(self) -> Optional[bytes]:
        """The raw state of NumPy's global generator, or None where it cannot be read so."""
        try:
            bg = np.random.mtrand._rand._bit_generator
            got = self._np_buf
            if got is None or got[0] is not bg:   # the buffer keeps its generator alive
                if type(bg).__name__ != "MT19937":
                    return None
                got = self._np_buf = (bg, (ctypes.c_char * _MT_BYTES).from_address(
                    bg.ctypes.state_address))
            return bytes(got[1])
        except Exception:   # another NumPy layout: every read is a full one
            return None

    def _python(self) -> tuple:
        fn = random.getstate
        src = self._py_src
        if src is None or src[0] is not fn:
            src = self._py_src = (fn, *_py_words_of(fn))
        if src[2] is None:
            return fn()
        # the words and the cached Gaussian before the state: a change between the two reads
        # then makes the next read a full one
        words, gauss = bytes(src[2]), src[1].gauss_next
        last = self._py_state
        if last is not None and words == self._py_words and gauss is self._py_gauss:
            return last
        self._py_words, self._py_gauss, self._py_state = words, gauss, fn()
        return self._py_state


def _py_words_of(fn) -> tuple:
    """(generator, its raw words in place) for `random.getstate` bound to a random.Random whose
    memory holds, after the object header, the C int index and the 624 uint32 words (CPython's
    RandomObject), as a full read of it says; else (None, None): every read is a full one."""
    try:
        inst = getattr(fn, "__self__", None)
        if (not isinstance(inst, random.Random) or getattr(fn, "__func__", None)
                is not random.Random.getstate
                or _random.Random.__basicsize__ < object.__basicsize__ + _MT_BYTES):
            return None, None
        buf = (ctypes.c_char * _MT_BYTES).from_address(id(inst) + object.__basicsize__)
        state = inst.getstate()[1]   # the 624 words, then the index
        if len(state) != 625 or bytes(buf) != struct.pack("=i624I", state[-1], *state[:-1]):
            return None, None
        return inst, buf
    except Exception:
        return None, None
