"""The Monitor's link to torch.distributed: lockstep flushes, one collective each.

Lockstep. A collective must be entered by every rank the same number of times, in the same
order, whatever each rank saw. So nothing here depends on timing, data or alerts:
- a flush happens at every `dist.flush_every`-th step end, counted on each rank (all ranks run
  the same number of `mon.step` blocks, as they must for their own collectives), and at close();
- a flush carries the frames of exactly the step ends before the current one (not the one just
  ended, whose device copies may still be in flight): on CUDA they were queued a step earlier,
  so reading them rarely waits; which frames go is decided from step-end counts, not from
  whether a copy has landed (`StatsBuffer.poll(block=True, limit=...)`);
- rows are identified by a hash of (module, role), not by slot numbers (which follow first touch
  and may differ between ranks); a row missing on a rank is simply absent from its payload,
  which is the identity of the merge;
- each flush (dist.merge="reduce", the default) is a few all-reduces of tensors whose shapes
  every rank knows (rounds.py): the payload per rank does not grow with the world size; on
  the job's group (dist.backend "default", "auto" on NCCL) each is queued on the device and
  read at the next step end (deferred.py), so flushes overlap and the host never waits; with
  dist.merge="gather" it is one fixed-size all-gather (`wire.py`), repeated once with a larger
  size only when some rank's rows outgrow the agreed one;
- detectors, alerts, captures and sinks run after the collective and never add or skip one.

Failure. On the gloo side group, a collective that fails or takes longer than `dist.timeout`
(a rank died, or left) detaches the monitor from the others: from then on each rank reads its
own frames and writes them to its own files (`alerts.rank{r}.jsonl`...), with a warning. On
the job's group a failing collective fails the job, as its own collectives would. A rank that closes tells the
others in its last payload, and they detach at once instead of waiting for a timeout.
"""
from __future__ import annotations

import collections
import datetime
import logging

import numpy as np
import torch

from ..config_distributed import DistBackend, DistMerge, DistMode
from ..stats.buffer import Phase
from ..stats.layout import N_STATS
from . import deferred, naming, reduce, rounds, wire
from .comm import Comm
from .dtensor import placement, shard_rows, to_local
from .merge import LocalFrame, _stack, local_frames, merged_frames, payload_rows
from .runinfo import FrameSource, RunInfo

log = logging.getLogger("stabilitywatch")

INITIAL_CAPACITY = 1 << 16
_PARAM_PHASES = (Phase.WEIGHT, Phase.GRAD, Phase.OPTIM)
# sinks that create nothing until written to: non-zero ranks keep them for the fallback
LAZY_SINKS = ("jsonl", "console")


def dist_info() -> tuple[int, int]:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except Exception:
        pass
    return 0, 1


class Coordinator:
    """One process, or ranks that exchange nothing (dist.mode="per_rank" without divergence):
    frames pass straight through; DTensors are read as their local shard."""

    active = False

    def __init__(self, run: RunInfo):
        self.run = run

    def local(self, t: torch.Tensor, module: str, role: str) -> torch.Tensor:
        return to_local(t)

    def frames(self, buffer: FrameSource, final: bool) -> list:
        """Called once per step end (final=False) and at close (final=True)."""
        return buffer.poll(block=final, rank=self.run.rank, world_size=self.run.world_size)

    def detectors(self) -> list:
        return []

    def sink_config(self, config):
        return config

    def annotate(self, frame, alerts: list) -> list:
        return alerts

    def record_fields(self, frame) -> dict:
        """Extra keys of a frame's stats records: {"merged": bool} in a distributed run."""
        return {}

    def close(self) -> None:
        pass


class DistCoordinator(Coordinator):
    active = True

    def __init__(self, run: RunInfo):
        super().__init__(run)
        import torch.distributed as dist
        self._dist = dist
        cfg = run.config
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mode: DistMode = cfg.dist.mode
        self.every = cfg.dist.flush_every
        self.compare = cfg.dist.divergence
        self.timeout = datetime.timedelta(seconds=cfg.dist.timeout)
        # gradients read before DDP's all-reduce (no optimizer: post-accumulate hooks) differ
        self.grads_replicated = run.has_optimizer
        self.merge: DistMerge = cfg.dist.merge
        self.group = None
        self.device = torch.device("cpu")
        nccl = dist.get_backend() == "nccl"
        backend = cfg.dist.backend
        if backend is DistBackend.AUTO:
            backend = DistBackend.DEFAULT if nccl and self.merge is DistMerge.REDUCE \
                else DistBackend.GLOO
        if backend is DistBackend.GLOO:
            # a CPU side group: our collectives never queue behind (or between) the job's own,
            # and never wait for the GPU. Making it is a collective: watch() runs on every rank.
            self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        elif nccl:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # the job's group with the reduction: queued on the device, read a step end later
        self.flights = deferred.Flights(deferred.Ops(dist, None, self.device)) \
            if backend is DistBackend.DEFAULT and self.merge is DistMerge.REDUCE else None
        self.path = "device" if self.flights is not None else backend.value
        self.capacity = INITIAL_CAPACITY
        self.names: dict[int, tuple[str, str]] = {}
        self.flushes = 0
        self.collectives = 0
        self.detached = False
        self._published: set[int] = set()
        self._ids: dict[tuple[str, str], int] = {}
        self._placement: dict[tuple[str, str], tuple[bool, bool]] = {}
        self._ends = 0
        self._entry_end: collections.deque = collections.deque()   # end index of each unread one
        self._cut = 0                       # the last step end a flush covered
        self._rows0: dict[tuple[str, str], tuple[int, int]] = {}   # FSDP2 dim-0 shards
        self.tables = reduce.Tables()
        self.comm = Comm(dist, self.group, self.device, self.timeout)

    # -- hot path (host bookkeeping only) ------------------------------------------------------
    def local(self, t: torch.Tensor, module: str, role: str) -> torch.Tensor:
        key = (module, role)
        if key not in self._placement:
            pl = placement(t)
            if pl is not None:
                self._placement[key] = pl
                rows = shard_rows(t)
                if rows is not None:
                    self._rows0[key] = rows
        return to_local(t)

    # -- step ends -----------------------------------------------------------------------------
    def frames(self, buffer: FrameSource, final: bool) -> list:
        if not final:
            self._ends += 1
            # called right after end_step: at most one new unread buffer entry, from this end
            if not self.detached and buffer.pending > len(self._entry_end):
                self._entry_end.append(self._ends)
        if self.detached:
            return self._fallback(buffer.poll(block=final, rank=self.run.rank,
                                              world_size=self.world))
        done = []
        if self.flights is not None:   # at close too: as the other ranks do at a step end
            try:
                done = self._landed(self.flights.advance())
            except Exception as e:
                done = self._flights_failed(e, [])
            if self.detached:
                return done + self._fallback(buffer.poll(block=final, rank=self.run.rank,
                                                         world_size=self.world))
        if final:
            take, cut = buffer.pending, self._ends
        elif self._ends % self.every == 0:
            take, cut = sum(1 for e in self._entry_end if e < self._ends), self._ends - 1
        else:
            return done
        got = buffer.poll(block=True, limit=take, rank=self.run.rank, world_size=self.world)
        local = [self._local_frame(self._entry_end.popleft(), f) for f in got]
        first, self._cut = self._cut + 1, cut
        if self.flights is not None:
            return done + self._launch(local, first, final)
        if self.merge is DistMerge.REDUCE:
            return self._reduce(local, first, final)
        return self._flush(local, final)

    # -- the reductions on the job's group, read a step end later (deferred.py) ----------------
    def _launch(self, local: list, first: int, final: bool) -> list:
        self.flushes += 1
        window = self._window(local, first)
        try:
            self.flights.start(rounds.plan(window, self.tables, self.rank,
                                           full=self.mode is DistMode.RANK0,
                                           compare=self.compare, final=final, stop_mixed=True),
                               (window, local))
            self.collectives = self.comm.calls + self.flights.ops.calls
            return self._landed(self.flights.drain()) if final else []
        except Exception as e:
            return self._flights_failed(e, [])

    def _landed(self, done: list) -> list:
        self.collectives = self.comm.calls + self.flights.ops.calls
        out = []
        for (window, local), red in done:
            if red.stopped:      # ranks that close and ranks that go on: each its own from now
                rest = [lf for _, lc in self.flights.abandon() for lf in lc]
                self._detach("a rank closed its monitor")
                return out + self._fallback([lf.frame for lf in local + rest])
            out += self._frames_of(red, window, local)
        return out

    def _flights_failed(self, e: Exception, done: list) -> list:
        rest = [lf for _, lc in self.flights.abandon() for lf in lc]
        self._detach(f"the flush reduction failed ({type(e).__name__}: {e})")
        return done + self._fallback([lf.frame for lf in rest])

    def _local_frame(self, end: int, frame) -> LocalFrame:
        ids, kinds = [], []
        for (m, r), ph in zip(frame.keys, frame.phases):
            k = self._ids.get((m, r))
            if k is None:
                k = self._ids[(m, r)] = wire.key_id(m, r)
            ids.append(k)
            kinds.append(self._kind((m, r), ph))
        return LocalFrame(end=end, frame=frame, key_ids=ids, kinds=kinds)

    def _kind(self, key, phase: int) -> int:
        pl = self._placement.get(key)
        if pl is not None and pl[0]:
            return wire.SHARDED | (wire.OWNER if pl[1] else 0)
        if phase in _PARAM_PHASES and (phase != Phase.GRAD or self.grads_replicated):
            return wire.REPLICATED
        return wire.LOCAL | wire.OWNER

    # -- the collective ------------------------------------------------------------------------
    def _flush(self, local: list, final: bool) -> list:
        self.flushes += 1
        parts = [payload_rows(lf, send_full=self.mode is DistMode.RANK0) for lf in local]
        new = sorted({k for lf in local for k in lf.key_ids} - self._published)
        key_name = {k: n for lf in local for k, n in zip(lf.key_ids, lf.frame.keys)}
        names = [[k, *key_name[k]] for k in new]
        full_a = _stack([p[0] for p in parts], wire.N_META + N_STATS)
        fp_a = _stack([p[1] for p in parts], wire.N_META + len(wire.FP_STATS))
        try:
            payloads = self._exchange(full_a, fp_a, names, final)
        except Exception as e:
            self._detach(f"the flush collective failed ({type(e).__name__}: {e})")
            return self._fallback([lf.frame for lf in local])
        self._published.update(new)
        for p in payloads:
            for k, m, r in p.names:
                self.names.setdefault(k, (m, r))
        gone = [p.rank for p in payloads if p.final and p.rank != self.rank]
        if self.mode is DistMode.RANK0:
            if self.rank == 0:
                out = merged_frames(payloads, self.names, local, self.run.rank, self.world)
            else:
                self._release(local)
                out = []
        else:
            out = local_frames(payloads, local, self.run.rank, self.world)
        if gone and not final:
            self._detach(f"rank(s) {', '.join(map(str, gone))} closed their monitor")
        return out

    def _exchange(self, full, fp, names, final) -> list:
        buf, need = wire.encode(self.rank, final, full, fp, names, self.capacity)
        payloads = self._gather(buf)
        if any(p.truncated for p in payloads):
            need = max(p.need for p in payloads)
            self.capacity = 1 << max(need - 1, 1).bit_length()
            buf, _ = wire.encode(self.rank, final, full, fp, names, self.capacity)
            payloads = self._gather(buf)
            if any(p.truncated for p in payloads):
                raise wire.WireError("ranks disagree on the payload size")
        return payloads

    def _gather(self, buf: np.ndarray) -> list:
        dist = self._dist
        inp = torch.from_numpy(buf).to(self.device)
        out = torch.empty(self.world * buf.size, dtype=torch.uint8, device=self.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(out, inp, group=self.group, async_op=True)
        work.wait(timeout=self.timeout)
        self.collectives += 1
        self.comm.bytes_sent += buf.size
        rows = out.cpu().numpy().reshape(self.world, buf.size)   # off the hot path: waits
        payloads = [wire.decode(rows[r]) for r in range(self.world)]
        if [p.rank for p in payloads] != list(range(self.world)):
            raise wire.WireError("payloads arrived out of rank order")
        return payloads

    # -- the reductions (rounds.py) -----------------------------------------------------------
    def _window(self, local: list, first: int) -> list:
        window = [None] * self.every
        for lf in local:
            window[lf.end - first] = lf    # the flush covers ends first .. first + every - 1
        return window

    def _reduce(self, local: list, first: int, final: bool) -> list:
        self.flushes += 1
        window = self._window(local, first)
        calls = self.comm.calls
        try:
            red = rounds.run(window, self.tables, self.comm, self.rank,
                             full=self.mode is DistMode.RANK0, compare=self.compare, final=final)
        except Exception as e:
            self.collectives += self.comm.calls - calls
            self._detach(f"the flush reduction failed ({type(e).__name__}: {e})")
            return self._fallback([lf.frame for lf in local])
        self.collectives += self.comm.calls - calls
        return self._frames_of(red, window, local)

    def _frames_of(self, red, window: list, local: list) -> list:
        try:
            if self.mode is DistMode.RANK0:
                if self.rank == 0:
                    out = rounds.merged(red, window, self.tables, self.run.rank, self.world,
                                        lambda key: self._placement.get(tuple(key), (False,))[0])
                else:
                    self._release(local)
                    out = []
            else:
                out = rounds.local(red, window, self.tables, self.run.rank, self.world)
        except Exception as e:   # host-side unpacking: the ranks stay in step, this flush is local
            log.warning("stabilitywatch: rank %d: reading the flush's reductions failed (%s: %s);"
                        " its frames are this rank's own", self.rank, type(e).__name__, e)
            out = self._fallback([lf.frame for lf in local])
        if red.others_final:
            self._detach("a rank closed its monitor")
        return out

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank contributed to the flush collectives so far."""
        return self.comm.bytes_sent + (self.flights.ops.bytes_sent if self.flights else 0)

    # -- after the collective ------------------------------------------------------------------
    def _release(self, local: list) -> None:
        """Frames this rank does not process itself still free what they hold."""
        for lf in local:
            self.run.release(lf.frame)

    def _fallback(self, frames: list) -> list:
        return local_frames([], [self._local_frame(-1, f) for f in frames], self.run.rank,
                            self.world)

    def _detach(self, why: str) -> None:
        if not self.detached:
            self.detached = True
            self._entry_end.clear()
            log.warning("stabilitywatch: rank %d: %s; from now on this rank reads and writes "
                        "its own statistics and alerts (per-rank files), without collectives",
                        self.rank, why)

    def detectors(self) -> list:
        from ..detectors.divergence import DivergenceDetector
        return [DivergenceDetector()] if self.compare else []

    def sink_config(self, config):
        if self.mode is DistMode.RANK0 and self.rank != 0:
            return config.replace(sinks=tuple(s for s in config.sinks.use if s in LAZY_SINKS))
        return config

    def record_fields(self, frame) -> dict:
        # merged: the row combines every rank's (rank0 mode); false: this rank's own rows
        return {"merged": bool(getattr(frame, "merged", False))}

    def annotate(self, frame, alerts: list) -> list:
        """Alerts on merged rows name the rank(s) whose rows hold them (naming.py)."""
        if not alerts or not isinstance(getattr(frame, "bad_ranks", None), dict):
            return alerts
        return [naming.annotate(frame, a, self.world, self._shard) for a in alerts]

    def _shard(self, key, rank: int):
        """The dim-0 rows of the unsharded tensor that `rank` holds (FSDP2's Shard(0))."""
        pl = self._placement.get(key)
        if pl is None or not pl[0] or key not in self._rows0:
            return None
        n, ranks = self._rows0[key]
        per = -(-n // ranks)     # torch.chunk: ceil(n / ranks) rows per rank, the last shorter
        lo = min(rank * per, n)
        return {"rank": rank, "of": ranks, "rows": [lo, min(lo + per, n)], "dim0": n}

    def close(self) -> None:
        if self.group is not None and not self.detached:
            try:
                self._dist.destroy_process_group(self.group)
            except Exception:
                pass
        self.group = None


def make_coordinator(run: RunInfo) -> Coordinator:
    rank, world = dist_info()
    cfg = run.config
    if world <= 1 or (cfg.dist.mode is DistMode.PER_RANK and not cfg.dist.divergence):
        return Coordinator(run)
    return DistCoordinator(run)
