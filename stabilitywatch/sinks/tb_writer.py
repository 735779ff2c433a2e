"""The TensorBoard sink's writer process: `python tb_writer.py LOG_DIR`.

Making ~8,500 protobuf values per 608-row frame and checksumming the 486 KB record took ~125 ms
of Python on the sink's thread, holding the GIL that the training thread takes back after every
PyTorch call. Here it runs in a process that imports tensorboard's event writer and protos (not
torch, not the package), with a numpy CRC-32C for large records (tb_crc.py).

Says "ready" once its imports worked. Messages (child_loop.py):
  ("tags", [tag, ...])                     appended to the tag table
  ("scalars", step, wall_time, idx, vals)  one Summary: tags[idx[k]] = vals[k] (array bytes,
                                           "i" and "d")
  ("text", tag, text, step, wall_time)     a text summary, as SummaryWriter.add_text writes it
  ("flush",) | ("close",)
"""
from __future__ import annotations

import os
import sys
from array import array

# this directory last: Python put it first (a script's own), where its modules (base.py,
# runner.py, ...) would shadow any library's of the same name
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE] + [_HERE]
import child_loop  # noqa: E402


def _fast_crc(record_writer) -> None:
    # tensorboard without TensorFlow checksums each record in pure Python (~63 ms per frame):
    # large records take tb_crc's numpy version (~5 ms), small ones keep tensorboard's
    slow = getattr(record_writer, "masked_crc32c", None)
    if slow is None:
        return
    try:
        import tb_crc
    except ImportError:  # no numpy: tensorboard's own
        return
    record_writer.masked_crc32c = lambda d: tb_crc.masked_crc32c(d) if len(d) >= 4096 else slow(d)


def main(log_dir: str) -> int:
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text import plugin_data_pb2
        from tensorboard.summary.writer import record_writer
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
        _fast_crc(record_writer)
        os.makedirs(log_dir, exist_ok=True)
        writer = EventFileWriter(log_dir)
    except OSError as e:
        child_loop.say(f"error {e.errno or 0} {e.strerror or e}")
        return 1
    except Exception as e:  # no tensorboard here: the sink writes in its own process
        child_loop.say(f"error 0 {type(e).__name__}: {e}")
        return 1
    child_loop.say("ready")
    Summary, Value = summary_pb2.Summary, summary_pb2.Summary.Value
    text_meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(
        plugin_name="text", content=plugin_data_pb2.TextPluginData(version=0).SerializeToString()))
    one = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)])
    tags: list[str] = []

    def handle(msg):
        kind = msg[0]
        if kind == "tags":
            tags.extend(msg[1])
        elif kind == "scalars":
            _, step, wall, idx, vals = msg
            i, v = array("i"), array("d")
            i.frombytes(idx)
            v.frombytes(vals)
            summary = Summary(value=[Value(tag=tags[k], simple_value=x) for k, x in zip(i, v)])
            writer.add_event(event_pb2.Event(wall_time=wall, step=step, summary=summary))
        elif kind == "text":
            _, tag, text, step, wall = msg
            value = Value(tag=f"{tag}/text_summary", metadata=text_meta, tensor=tensor_pb2.TensorProto(
                dtype="DT_STRING", string_val=[text.encode("utf-8")], tensor_shape=one))
            writer.add_event(event_pb2.Event(wall_time=wall, step=step,
                                             summary=Summary(value=[value])))
        else:
            raise ValueError(f"unknown message {kind!r}")

    return child_loop.serve(handle, writer.flush, writer.close)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
