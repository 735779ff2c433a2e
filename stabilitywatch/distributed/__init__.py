"""stabilitywatch under torch.distributed (DDP, FSDP2): DTensor shards, lockstep cross-rank
flushes with one collective each, merged rows on rank 0, replica fingerprints for the
divergence detector. See README "Many GPUs: torchrun" and coordinator.py."""
from .coordinator import Coordinator, DistCoordinator, make_coordinator
from .merge import DistFrame, KIND_NAMES

__all__ = ["Coordinator", "DistCoordinator", "DistFrame", "KIND_NAMES", "make_coordinator"]
