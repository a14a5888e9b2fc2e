"""The one batch format: exact tensors on the paper's worked example, equality with Hugging Face's collator."""

import pytest
import torch
from transformers import DataCollatorWithFlattening

from lit_packing.batch import IGNORE_INDEX, is_packed
from lit_packing.data.collate import PackedCollator, PaddedCollator

LENGTHS = (4, 8, 5, 11)  # the paper's worked example (arXiv 2407.09105)


def make_examples(lengths=LENGTHS, masked_prefix=0):
    examples, start = [], 1000
    for n in lengths:
        ids = list(range(start, start + n))
        labels = [IGNORE_INDEX] * min(masked_prefix, n) + ids[masked_prefix:]
        examples.append({"input_ids": ids, "labels": labels})
        start += 100
    return examples


def test_worked_example_exact_tensors():
    batch = PackedCollator()(make_examples())
    assert is_packed(batch)
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 12, 17, 28]
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 11
    expected_pos = [*range(4), *range(8), *range(5), *range(11)]
    assert batch["position_ids"].tolist() == [expected_pos]
    assert batch["seq_idx"].tolist() == [[0] * 4 + [1] * 8 + [2] * 5 + [3] * 11]
    labels = batch["labels"][0].tolist()
    assert [labels[i] for i in (0, 4, 12, 17)] == [IGNORE_INDEX] * 4
    assert labels[1:4] == [1001, 1002, 1003]
    assert batch["input_ids"].shape == (1, 28)
    assert batch["counts"] == {
        "examples": 4,
        "real_tokens": 28,
        "label_tokens": 24,
        "slot_tokens": 28,
        "attn_cost": 16 + 64 + 25 + 121,
        "sum_sq_lengths": 16 + 64 + 25 + 121,
        "truncated_tokens": 0,
    }


@pytest.mark.parametrize("masked_prefix", [0, 2])
@pytest.mark.parametrize("lengths", [LENGTHS, (1,), (7, 1, 1, 30, 2)])
def test_equals_huggingface_flattening_collator(lengths, masked_prefix):
    examples = make_examples(lengths, masked_prefix)
    ours = PackedCollator()(examples)
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(examples)
    assert set(theirs) <= set(ours)
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert ours[key].dtype == value.dtype, key
            assert torch.equal(ours[key], value), key
        else:
            assert ours[key] == value, key


def test_tail_padding_is_an_extra_masked_segment_counted_as_slots():
    batch = PackedCollator(pad_token_id=7, pad_to_multiple_of=16)(make_examples())
    assert batch["input_ids"].shape == (1, 32)
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 12, 17, 28, 32]
    assert batch["input_ids"][0, 28:].tolist() == [7] * 4
    assert batch["labels"][0, 28:].tolist() == [IGNORE_INDEX] * 4
    assert batch["position_ids"][0, 28:].tolist() == [0, 1, 2, 3]
    assert batch["counts"]["real_tokens"] == 28 and batch["counts"]["slot_tokens"] == 32
    assert batch["counts"]["examples"] == 4


def test_bucket_sizes_pick_the_smallest_fit_and_name_the_knob_when_none_fits():
    assert PackedCollator(bucket_sizes=[16, 64, 32])(make_examples())["input_ids"].shape == (1, 32)
    with pytest.raises(ValueError, match="bucket_sizes"):
        PackedCollator(bucket_sizes=[8, 16])(make_examples())


def test_contaminated_fixed_length_rows_have_continuous_positions():
    batch = PackedCollator(isolate=False, row_length=16)(make_examples())
    assert batch["cu_seq_lens_q"].tolist() == [0, 16, 28]
    assert batch["position_ids"][0].tolist() == [*range(16), *range(12)]
    assert batch["max_length_q"] == 16
    # Labels still never cross an example boundary: the counts are those of the isolated batch.
    assert batch["counts"]["label_tokens"] == 24


def test_empty_pack_is_one_masked_token():
    batch = PackedCollator()([])
    assert batch["input_ids"].shape == (1, 1)
    assert batch["labels"].tolist() == [[IGNORE_INDEX]]
    assert batch["counts"]["examples"] == 0 and batch["counts"]["label_tokens"] == 0
    assert batch["counts"]["slot_tokens"] == 1 and batch["counts"]["real_tokens"] == 0
    padded = PaddedCollator()([])
    assert padded["input_ids"].shape == (1, 1) and padded["counts"]["label_tokens"] == 0


def test_padded_collator_matches_packed_targets_and_counts_padding():
    examples = make_examples(masked_prefix=1)
    padded = PaddedCollator(pad_token_id=2)(examples)
    packed = PackedCollator()(examples)
    assert padded["input_ids"].shape == (4, 11)
    assert padded["attention_mask"].sum().item() == 28
    assert padded["input_ids"][0, 4:].tolist() == [2] * 7
    kept = padded["labels"][padded["attention_mask"].bool()]
    assert torch.equal(kept, packed["labels"][0])
    assert padded["counts"]["slot_tokens"] == 44
    assert padded["counts"]["attn_cost"] == 4 * 11 * 11
    assert padded["counts"]["label_tokens"] == packed["counts"]["label_tokens"]
    assert PaddedCollator(pad_to_multiple_of=8)(examples)["input_ids"].shape == (4, 16)
