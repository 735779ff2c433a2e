"""Read a W&B run's .wandb transaction log back, without the network or the wandb service.

Format (written by wandb-core; checked against wandb 0.31 output):
- a 7-byte file header: b":W&B", magic 0xBEE1 (uint16 little-endian), version byte 0;
- then LevelDB-style log blocks of 32 KiB, counted from file offset 0 (so the first block
  holds the file header too);
- each chunk has a 7-byte header: crc32 (uint32 LE, zlib/IEEE CRC of the type byte followed by
  the data, not masked), length (uint16 LE), type (1 FULL, 2 FIRST, 3 MIDDLE, 4 LAST);
- a chunk never crosses a block boundary: a record that does not fit is split into
  FIRST/MIDDLE.../LAST chunks; a block remainder shorter than 7 bytes is zero padding.
Each reassembled record is one serialized wandb.proto.wandb_internal_pb2.Record.
"""
from __future__ import annotations

import glob
import json
import os
import struct
import time
import zlib
from typing import Any, Iterator

BLOCK_SIZE = 32 * 1024
CHUNK_HEADER = 7
FILE_HEADER = struct.Struct("<4sHB")
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def find_run_files(run_dir: str) -> list[str]:
    """Every run-*.wandb file of offline runs under run_dir/wandb."""
    return sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")))


def iter_chunks(path: str) -> Iterator[tuple[int, bytes]]:
    """(type, data) of every chunk, checksums verified."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < FILE_HEADER.size:
        raise ValueError(f"{path}: no file header yet ({len(data)} bytes)")
    ident, magic, version = FILE_HEADER.unpack_from(data, 0)
    if ident != b":W&B" or magic != 0xBEE1 or version != 0:
        raise ValueError(f"{path}: not a .wandb file (header {data[:7]!r})")
    pos = FILE_HEADER.size
    while pos < len(data):
        left_in_block = BLOCK_SIZE - pos % BLOCK_SIZE
        if left_in_block < CHUNK_HEADER:
            if data[pos:pos + left_in_block].strip(b"\0"):
                raise ValueError(f"{path}: non-zero block padding at offset {pos}")
            pos += left_in_block
            continue
        if pos + CHUNK_HEADER > len(data):
            raise ValueError(f"{path}: truncated chunk header at offset {pos}")
        crc, length, kind = struct.unpack_from("<IHB", data, pos)
        body = data[pos + CHUNK_HEADER:pos + CHUNK_HEADER + length]
        if len(body) != length or CHUNK_HEADER + length > left_in_block:
            raise ValueError(f"{path}: chunk at offset {pos} overruns its block or the file")
        if zlib.crc32(bytes([kind]) + body) != crc:
            raise ValueError(f"{path}: checksum mismatch at offset {pos}")
        yield kind, body
        pos += CHUNK_HEADER + length


def iter_raw_records(path: str) -> Iterator[bytes]:
    """Serialized records, reassembled from FULL or FIRST/MIDDLE.../LAST chunks."""
    pending: bytearray | None = None
    for kind, body in iter_chunks(path):
        if kind == FULL:
            if pending is not None:
                raise ValueError(f"{path}: FULL chunk inside a split record")
            yield body
        elif kind == FIRST:
            if pending is not None:
                raise ValueError(f"{path}: FIRST chunk inside a split record")
            pending = bytearray(body)
        elif kind in (MIDDLE, LAST):
            if pending is None:
                raise ValueError(f"{path}: chunk type {kind} without FIRST")
            pending += body
            if kind == LAST:
                yield bytes(pending)
                pending = None
        else:
            raise ValueError(f"{path}: unknown chunk type {kind}")
    if pending is not None:
        raise ValueError(f"{path}: file ends inside a split record")


def read_records(path: str) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    out = []
    for raw in iter_raw_records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(raw)
        out.append(rec)
    return out


def read_finished_run(path: str, timeout: float = 20.0, need_exit: bool = True,
                      until=None) -> list[Any]:
    """Records of a finished run. wandb 0.31's run.finish() returns before wandb-core has closed
    the file (the service is told to close the stream without waiting), so poll until the file
    parses completely and holds the run's exit record (need_exit), and until(records) is true
    when given (a killed run has no exit record: wait for what it must hold)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            records = read_records(path)
            done = (not need_exit
                    or any(r.WhichOneof("record_type") == "exit" for r in records))
            if done and (until is None or until(records)):
                return records
            problem = "no exit record yet" if not done else "not there yet"
        except ValueError as e:          # caught mid-write: a record is still incomplete
            problem = str(e)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: run not complete after {timeout} s ({problem})")
        time.sleep(0.05)


def _item_value(item) -> Any:
    # Values are JSON text; wandb writes non-finite floats as bare NaN/Infinity, which json reads.
    return json.loads(item.value_json)


def _put(row: dict[str, Any], item) -> None:
    """A key path of several parts (e.g. a logged Table's fields) becomes nested dicts."""
    path = list(item.nested_key) or [item.key]
    for part in path[:-1]:
        row = row.setdefault(part, {})
    row[path[-1]] = _item_value(item)


def history_rows(records: list[Any]) -> list[dict[str, Any]]:
    rows = []
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            row: dict[str, Any] = {}
            for item in rec.history.item:
                _put(row, item)
            rows.append(row)
    return rows


def records_of(records: list[Any], kind: str) -> list[Any]:
    """The payloads of one record_type ("alert", "metric", "summary", ...)."""
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]
