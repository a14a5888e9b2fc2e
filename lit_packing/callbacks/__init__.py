"""Callbacks: packing quality and real-token throughput from the host-side counts of every batch, and the CLI's
defaults for progress, validation cadence and checkpoints."""

from lit_packing.callbacks.checkpoint import LastCheckpoint
from lit_packing.callbacks.packing import PackingMonitor
from lit_packing.callbacks.progress import ProgressLog, StepProgressBar
from lit_packing.callbacks.throughput import TokenThroughputMonitor
from lit_packing.callbacks.validation import ValidationSchedule

__all__ = [
    "LastCheckpoint",
    "PackingMonitor",
    "ProgressLog",
    "StepProgressBar",
    "TokenThroughputMonitor",
    "ValidationSchedule",
]
