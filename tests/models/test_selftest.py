"""The isolation self-test (`lit_packing.models.selftest.check_isolation`): the packed forward of the real model
against each example alone, failing on a backend that ignores the boundaries and on positions that run on."""

from __future__ import annotations

import pytest
import torch

from lit_packing.data.collate import PackedCollator
from lit_packing.errors import IsolationError
from lit_packing.models.selftest import check_isolation
from tests.helpers import broken_backend, make_examples, packed_model

LENGTHS = [9, 4, 15, 6, 6, 11, 2, 8]


def test_self_test_catches_backend_that_ignores_cu_seq_lens(tiny_config):
    model = packed_model(tiny_config)
    batch = PackedCollator()(make_examples(LENGTHS))
    assert check_isolation(model, batch, "per_example") < 1e-4
    model.set_attn_implementation(broken_backend())
    with pytest.raises(IsolationError, match=r"attn_backend=broken.*max abs"):
        check_isolation(model, batch, "broken")


def test_self_test_catches_running_positions(tiny_config):
    """Position ids that run on across examples: transformers' own sdpa path then sees one long sequence."""
    model = packed_model(tiny_config)
    model.set_attn_implementation("sdpa")  # isolates packed rows from restarting position_ids alone
    batch = PackedCollator()(make_examples(LENGTHS))
    assert check_isolation(model, batch, "sdpa") < 1e-4
    batch["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    with pytest.raises(IsolationError, match="attn_backend=sdpa.*max abs"):
        check_isolation(model, batch, "sdpa")
