"""`python -m benchmarks.vlm --tiny`: the packed and the padded row train the same image chats to the same summed
losses, every number finite and the packed row without padding; the padded row's collator labels the assistant
turns only."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from benchmarks.vlm import ROWS, ProcessorCollator, main


def test_the_tiny_run_trains_both_rows_to_the_same_losses_and_packs_away_the_padding(capsys):
    report = main(["--tiny", "--per_step", "2", "--warmup", "1", "--steps", "1"])  # 2 steps: one optimizer update
    out = capsys.readouterr().out
    packed, padded = report["rows"]["packed"], report["rows"]["padded"]
    assert len(packed["loss_sums"]) == len(padded["loss_sums"]) == 2
    assert packed["label_tokens"] == padded["label_tokens"] and report["same_labels"]
    assert all(math.isfinite(loss) and loss > 0 for row in (packed, padded) for loss in row["loss_sums"])
    # The same summed loss over the same tokens, before and after an update of the same weights: fp32 rounding.
    assert report["loss_max_rel_diff"] < 1e-5
    for row in (packed, padded):
        numbers = [row[key] for key in ("tokens_per_s", "peak_rss_gib", "rise_gib", "input_seconds_per_step")]
        assert all(math.isfinite(x) for x in numbers) and row["tokens_per_s"] > 0 and row["peak_rss_gib"] > 0
    assert packed["real_tokens"] == padded["real_tokens"] == packed["slots"] < padded["slots"]
    assert packed["padding_ratio"] == 0.0 < padded["padding_ratio"]
    assert padded["vs_padded"] == 1.0 and packed["vs_padded"] == pytest.approx(
        packed["tokens_per_s"] / padded["tokens_per_s"]
    )
    for name, label in ROWS.items():  # the table prints each row's own numbers
        line = next(line for line in out.splitlines() if line.startswith(label))
        assert f"{report['rows'][name]['tokens_per_s']:.1f}" in line and f"{report['rows'][name]['slots']:,}" in line


def test_the_padded_collator_labels_each_assistant_turn_through_its_end_of_turn(smollm2_tokenizer):
    """ChatML: `<|im_start|>`=1, `ass` `istant` `\\n` = 520 9531 198, `<|im_end|>`=2, also the padding id."""
    collate = ProcessorCollator(SimpleNamespace(tokenizer=smollm2_tokenizer))
    ids = torch.tensor([
        [1, 4093, 198, 6004, 2, 198, 1, 520, 9531, 198, 16591, 2, 198],  # user: hi / assistant: blue
        [1, 520, 9531, 198, 455, 2, 198, 2, 2, 2, 2, 2, 2],  # assistant: red, then 6 pads
    ])  # fmt: skip
    mask = torch.tensor([[1] * 13, [1] * 7 + [0] * 6])
    expected = torch.tensor([
        [-100] * 10 + [16591, 2, -100],
        [-100] * 4 + [455, 2] + [-100] * 7,
    ])  # fmt: skip
    assert torch.equal(collate.labels(ids, mask), expected)
