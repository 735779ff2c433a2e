"""The TensorBoard sink's event writer: `python tb_writer.py LOG_DIR` (a process of its own), or
`open_writer(LOG_DIR)` in the sink's process where that cannot start.

Making ~8,500 protobuf values per 608-row frame and checksumming the 486 KB record took ~125 ms
of Python on the sink's thread, holding the GIL that the training thread takes back after every
PyTorch call. As a process it imports tensorboard's event writer and protos (not torch, not the
package). Records are checksummed by a CRC-32C package where one imports (google-crc32c, then
crc32c), else by numpy for large records (tb_crc.py).

Says "ready" once its imports worked. Messages (child_loop.py):
  ("tags", [tag, ...])                     appended to the tag table
  ("scalars", step, wall_time, idx, vals)  one Summary: tags[idx[k]] = vals[k] (array bytes,
                                           "i" and "d")
  ("histos", step, wall_time, [(tag, first, counts), ...])   exponent histograms: counts
                                           (array "d" bytes) of floor(log2|x|) = first, first+1...
  ("text", tag, text, step, wall_time)     a text summary, as SummaryWriter.add_text writes it
  ("hparams", {name: value})               the run's hparams (TensorBoard's hparams start record)
  ("flush",) | ("close",)
"""
from __future__ import annotations

import os
import sys
import time
from array import array


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def fast_crc(record_writer) -> str:
    """Point tensorboard's record writer at a fast CRC-32C (without TensorFlow it computes one
    byte at a time in Python, ~63 ms per frame). Returns which one it uses."""
    slow = getattr(record_writer, "masked_crc32c", None)
    if slow is None:
        return "tensorboard"
    try:
        import google_crc32c
        if google_crc32c.implementation == "c":
            record_writer.masked_crc32c = lambda d: _masked(google_crc32c.value(bytes(d)))
            return "google-crc32c"
    except ImportError:
        pass
    try:
        import crc32c
        record_writer.masked_crc32c = lambda d: _masked(crc32c.crc32c(d))
        return "crc32c"
    except ImportError:
        pass
    try:
        if __package__:
            from . import tb_crc
        else:  # run as a script: this directory is on the path (never the package: torch)
            import tb_crc
    except ImportError:  # no numpy: tensorboard's own
        return "tensorboard"
    record_writer.masked_crc32c = lambda d: tb_crc.masked_crc32c(d) if len(d) >= 4096 else slow(d)
    return "numpy"


def open_writer(log_dir: str):
    """(handle(msg), flush(), close()) writing the messages above into LOG_DIR."""
    from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
    from tensorboard.plugins.text import plugin_data_pb2
    from tensorboard.summary.writer import record_writer
    from tensorboard.summary.writer.event_file_writer import EventFileWriter
    fast_crc(record_writer)
    os.makedirs(log_dir, exist_ok=True)
    writer = EventFileWriter(log_dir)
    Summary, Value = summary_pb2.Summary, summary_pb2.Summary.Value
    text_meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(
        plugin_name="text", content=plugin_data_pb2.TextPluginData(version=0).SerializeToString()))
    one = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)])
    tags: list[str] = []

    def event(step, wall, values):
        writer.add_event(event_pb2.Event(wall_time=wall, step=step,
                                         summary=Summary(value=values)))

    def handle(msg):
        kind = msg[0]
        if kind == "tags":
            tags.extend(msg[1])
        elif kind == "scalars":
            _, step, wall, idx, vals = msg
            i, v = array("i"), array("d")
            i.frombytes(idx)
            v.frombytes(vals)
            event(step, wall, [Value(tag=tags[k], simple_value=x) for k, x in zip(i, v)])
        elif kind == "histos":
            _, step, wall, items = msg
            values = []
            for tag, first, raw in items:
                c = array("d")
                c.frombytes(raw)
                n = len(c)
                centers = [first + k + 0.5 for k in range(n)]
                values.append(Value(tag=tag, histo=summary_pb2.HistogramProto(
                    min=float(first), max=float(first + n), num=float(sum(c)),
                    sum=sum(x * w for x, w in zip(centers, c)),
                    sum_squares=sum(x * x * w for x, w in zip(centers, c)),
                    bucket_limit=[float(first + k + 1) for k in range(n)], bucket=list(c))))
            if values:
                event(step, wall, values)
        elif kind == "text":
            _, tag, text, step, wall = msg
            event(step, wall, [Value(tag=f"{tag}/text_summary", metadata=text_meta,
                                     tensor=tensor_pb2.TensorProto(
                                         dtype="DT_STRING", string_val=[text.encode("utf-8")],
                                         tensor_shape=one))])
        elif kind == "hparams":
            from tensorboard.plugins.hparams import summary_v2
            summary = summary_v2.hparams_pb(msg[1])
            writer.add_event(event_pb2.Event(wall_time=time.time(), step=0, summary=summary))
        else:
            raise ValueError(f"unknown message {kind!r}")

    return handle, writer.flush, writer.close


def main(log_dir: str) -> int:
    import child_loop
    try:
        handle, flush, close = open_writer(log_dir)
    except OSError as e:
        child_loop.say(f"error {e.errno or 0} {e.strerror or e}")
        return 1
    except Exception as e:  # no tensorboard here: the sink writes in its own process
        child_loop.say(f"error 0 {type(e).__name__}: {e}")
        return 1
    child_loop.say("ready")
    return child_loop.serve(handle, flush, close)


if __name__ == "__main__":
    # this directory last: Python put it first (a script's own), where its modules (base.py,
    # runner.py, ...) would shadow any library's of the same name
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [_HERE]
    sys.exit(main(sys.argv[1]))
