"""Callbacks that read the host-side counts of every batch: packing quality and real-token throughput."""

from lit_packing.callbacks.packing import PackingMonitor
from lit_packing.callbacks.throughput import TokenThroughputMonitor

__all__ = ["PackingMonitor", "TokenThroughputMonitor"]
