"""The emulated-GPU tier: a simulated sm90 machine with exact reference kernels under the real GPU code paths."""

from __future__ import annotations

import pytest

from tests.emulated.machine import SimulatedGPU


@pytest.fixture
def emulated_gpu():
    """A simulated one-GPU machine with flash-attn installed (its real Python interface over reference kernels)."""
    with SimulatedGPU() as machine:
        yield machine


@pytest.fixture
def emulated_gpu_without_flash_attn():
    """A simulated GPU machine on which flash-attn is not installed: `torch_varlen` is all there is."""
    with SimulatedGPU(flash_attn=False) as machine:
        yield machine
