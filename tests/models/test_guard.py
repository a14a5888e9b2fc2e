"""The batch guard (`lit_packing.models.guard.check_packed_batch`): every way a packed batch can let examples see
each other, refused on the host before the transfer, in one line naming it."""

from __future__ import annotations

import pytest
import torch

from lit_packing.data.collate import PackedCollator
from lit_packing.errors import IsolationError
from lit_packing.models.guard import check_packed_batch
from tests.helpers import make_examples

LENGTHS = [9, 4, 15, 6]


def packed() -> dict:
    return PackedCollator()(make_examples(LENGTHS))


def test_a_well_formed_packed_batch_passes():
    check_packed_batch(packed())


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda b: b.update(attention_mask=torch.ones_like(b["input_ids"])), "also carries a 2D attention_mask"),
        (lambda b: b.update(position_ids=torch.arange(b["input_ids"].shape[1])[None]), "position_ids do not restart"),
        (lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 9, 13], dtype=torch.int32)), "does not cover the T=34"),
        (lambda b: b.update(max_length_q=3), "max_length_q=3 < the longest example (15 tokens)"),
        (lambda b: b.pop("position_ids"), "needs position_ids restarting at 0"),
        (
            lambda b: b.update(cu_seq_lens_k=torch.tensor([0, 9, 14, 28, 34], dtype=torch.int32)),
            "cu_seq_lens_k differs",
        ),
    ],
)
def test_a_spoiled_packed_batch_is_refused_in_one_line(spoil, message):
    batch = packed()
    spoil(batch)
    with pytest.raises(IsolationError) as raised:
        check_packed_batch(batch)
    assert message in str(raised.value) and "\n" not in str(raised.value), str(raised.value)


def test_restarting_positions_without_cu_seq_lens_are_refused():
    batch = packed()
    for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        batch.pop(key)
    with pytest.raises(IsolationError, match="without cu_seq_lens_q/k: use PackedCollator"):
        check_packed_batch(batch)
