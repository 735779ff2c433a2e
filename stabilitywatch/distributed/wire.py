"""What one rank puts into a flush all-gather (dist.merge="gather"), as bytes, and how they are
read back; the key hashes and fingerprint fields every merge uses.

Every rank contributes a buffer of the same agreed size (`capacity` bytes, identical on all
ranks, so one fixed-size all-gather carries everything):

    header   8 x int64   MAGIC, VERSION, rank, flags, n_full, n_fp, names_len, need
    full     n_full x (META + N_STATS) float64   whole statistics rows (merged on rank 0)
    fp       n_fp x (META + FP_STATS) float64    fingerprints of replicated tensors (compared)
    names    names_len bytes of JSON             [[key, module, role], ...] not yet published

Rows are identified by `key`, a 52-bit hash of (module, role), so ranks need not agree on slot
numbers; names travel once per rank and key. When a rank needs more than `capacity` bytes it
sends the header alone with `need` set; every rank then sees the same headers and repeats the
collective with the larger size (the only case with a second collective in a flush).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import numpy as np

from ..stats.layout import FP_STATS, N_STATS, Stat

MAGIC = 0x5357_4449_5354_0001
VERSION = 2  # 2: rows with the shifted sums (stats/layout.py)
HEADER_WORDS = 8
HEADER_BYTES = 8 * HEADER_WORDS

# per-row metadata columns, before the statistics
META = ("end", "step", "key", "phase", "seq", "flags", "scale")
M_END, M_STEP, M_KEY, M_PHASE, M_SEQ, M_FLAGS, M_SCALE = range(len(META))
N_META = len(META)

FP_INDEX = np.array([int(s) for s in FP_STATS])

# flags: kind in the low two bits, bit 2 set when this rank's row counts in a sharded merge
LOCAL, SHARDED, REPLICATED = 0, 1, 2
OWNER = 4
F_FINAL = 1          # header flag: the sender closes after this flush
F_TRUNCATED = 2      # header flag: the sender's rows did not fit; repeat with `need` bytes


class WireError(ValueError):
    """A buffer that is not a stabilitywatch payload (a mismatched or corrupted collective)."""


def key_id(module: str, role: str) -> int:
    """Rank-independent 52-bit id of a (module, role) row (exact in float64)."""
    h = hashlib.blake2b(f"{module}\0{role}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 52) - 1)


@dataclass
class Payload:
    rank: int
    final: bool
    truncated: bool
    need: int
    full: np.ndarray = field(default_factory=lambda: np.zeros((0, N_META + N_STATS)))
    fp: np.ndarray = field(default_factory=lambda: np.zeros((0, N_META + len(FP_STATS))))
    names: list = field(default_factory=list)


def size_of(n_full: int, n_fp: int, names: bytes) -> int:
    return HEADER_BYTES + 8 * (n_full * (N_META + N_STATS) + n_fp * (N_META + len(FP_STATS))) \
        + len(names)


def encode(rank: int, final: bool, full: np.ndarray, fp: np.ndarray,
           names: list, capacity: int) -> tuple[np.ndarray, int]:
    """(buffer of `capacity` bytes, bytes needed). When the rows do not fit, the buffer holds
    the header alone, flagged truncated."""
    full = np.ascontiguousarray(full, dtype=np.float64).reshape(-1, N_META + N_STATS)
    fp = np.ascontiguousarray(fp, dtype=np.float64).reshape(-1, N_META + len(FP_STATS))
    blob = json.dumps(names, separators=(",", ":")).encode() if names else b""
    need = size_of(len(full), len(fp), blob)
    buf = np.zeros(capacity, dtype=np.uint8)
    fits = need <= capacity
    flags = (F_FINAL if final else 0) | (0 if fits else F_TRUNCATED)
    head = np.array([MAGIC, VERSION, rank, flags, len(full), len(fp), len(blob), need],
                    dtype=np.int64)
    buf[:HEADER_BYTES] = head.view(np.uint8)
    if fits:
        o = HEADER_BYTES
        for part in (full.view(np.uint8).reshape(-1), fp.view(np.uint8).reshape(-1),
                     np.frombuffer(blob, dtype=np.uint8)):
            buf[o:o + part.size] = part
            o += part.size
    return buf, need


def decode(buf: np.ndarray) -> Payload:
    buf = np.ascontiguousarray(buf, dtype=np.uint8).reshape(-1)
    if buf.size < HEADER_BYTES:
        raise WireError("payload shorter than its header")
    magic, version, rank, flags, n_full, n_fp, n_names, need = \
        (int(v) for v in buf[:HEADER_BYTES].view(np.int64))
    if magic != MAGIC or version != VERSION:
        raise WireError(f"not a stabilitywatch payload (magic {magic:#x}, version {version})")
    if min(n_full, n_fp, n_names, rank) < 0 or need < HEADER_BYTES:
        raise WireError("corrupted payload header")
    p = Payload(rank=rank, final=bool(flags & F_FINAL), truncated=bool(flags & F_TRUNCATED),
                need=need)
    if p.truncated:
        return p
    blob = b""
    if need != size_of(n_full, n_fp, b"") + n_names or need > buf.size:
        raise WireError("payload sizes do not add up")
    o = HEADER_BYTES
    w_full, w_fp = N_META + N_STATS, N_META + len(FP_STATS)
    p.full = buf[o:o + 8 * n_full * w_full].view(np.float64).reshape(n_full, w_full).copy()
    o += 8 * n_full * w_full
    p.fp = buf[o:o + 8 * n_fp * w_fp].view(np.float64).reshape(n_fp, w_fp).copy()
    o += 8 * n_fp * w_fp
    blob = buf[o:o + n_names].tobytes()
    if blob:
        try:
            p.names = [(int(k), str(m), str(r)) for k, m, r in json.loads(blob.decode())]
        except (ValueError, TypeError) as e:
            raise WireError(f"corrupted key names ({e})") from None
    return p
