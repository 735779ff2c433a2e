"""stabilitywatch under torch.distributed (DDP, FSDP2): DTensor shards, lockstep cross-rank
flushes merged by reduction (rounds.py, reduce.py; the all-gather of wire.py on request), merged
rows on rank 0, replica digests for the divergence detector. See README "Many GPUs: torchrun",
docs/distributed.md and coordinator.py. It is handed a RunInfo (runinfo.py), not the Monitor."""
from .coordinator import Coordinator, DistCoordinator, make_coordinator
from .merge import DistFrame, KIND_NAMES

__all__ = ["Coordinator", "DistCoordinator", "DistFrame", "KIND_NAMES", "make_coordinator"]
