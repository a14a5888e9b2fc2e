"""The two feeds hand the collator the same thing: for the same examples of a real packaged source, the cached
path's `TokenizedDataset` and a stream's `Window` give the same items (whole and token slices), lengths and label
counts, and tokenization reports the same counts."""

from __future__ import annotations

import numpy as np
import pytest

from lit_packing.batch import INDEX, INPUT_IDS, LABELS, TRUNCATED_TOKENS
from lit_packing.data import ChampChats
from lit_packing.data.stream import Interleaver, InterleaveState, Stream, TokenizeRules
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset

EXAMPLES, MAX_LENGTH = 24, 512  # the first rows of CHAMP's chats (configs/quickstart.yaml's source)


@pytest.fixture(scope="module")
def both(tmp_path_factory, smollm2_tokenizer):
    """`(cached, window, cached report, streamed report)` for the source's first `EXAMPLES` rows."""
    cache, source = str(tmp_path_factory.mktemp("protocol")), ChampChats()
    rules = TokenizeRules(smollm2_tokenizer, MAX_LENGTH, "truncate", "completion", "error")
    stream = Stream(source, rules, buffer_size=EXAMPLES, seed=0, cache_dir=cache, limit=EXAMPLES)
    assert len(stream.rows[0].shards) == 1  # one shard: an example's id is its row, as the cached index is
    interleaver = Interleaver(stream, epoch=0, state=InterleaveState.start(1))
    window = interleaver.window(0)
    assert interleaver.window(1) is None  # the limit's rows make one window
    rows = np.arange(EXAMPLES)
    tokenized, report = tokenize_dataset(
        source.load(cache_dir=cache).select(rows), smollm2_tokenizer, MAX_LENGTH, "truncate", "completion",
        rows=rows, row_name=source.row_name,
    )  # fmt: skip
    return TokenizedDataset(tokenized), window, report, interleaver.report


def equal_items(a: dict, b: dict) -> bool:
    return (
        a.keys() == b.keys()
        and np.array_equal(a[INPUT_IDS], b[INPUT_IDS])
        and np.array_equal(a[LABELS], b[LABELS])
        and a[INDEX] == b[INDEX]
        and a.get(TRUNCATED_TOKENS) == b.get(TRUNCATED_TOKENS)
    )


def test_a_cached_dataset_and_a_stream_window_give_the_same_items_and_label_counts(both):
    cached, window, cached_report, streamed_report = both
    assert 0 < len(window) == len(cached) <= EXAMPLES and cached_report.truncated_examples > 0  # some are cut
    at = {int(cached[k][INDEX]): k for k in range(len(cached))}
    assert sorted(at) == sorted(window.ids.tolist())  # the same examples kept, by their row in the source
    whole = list(range(len(window)))
    mine = [at[int(i)] for i in window.ids]  # each window key's row in the cached dataset
    assert all(equal_items(window[k], cached[c]) for k, c in zip(whole, mine))
    np.testing.assert_array_equal(window.lengths, cached.lengths[mine])
    assert window.count_labels(whole) == cached.count_labels(mine) == cached.label_tokens[mine].tolist()
    cut = [(k, 3, min(40, int(window.lengths[k]))) for k in whole]  # token slices (FixedLengthPackingSampler's)
    cut_cached = [(c, start, stop) for c, (_, start, stop) in zip(mine, cut)]
    assert all(equal_items(window[s], cached[c]) for s, c in zip(cut, cut_cached))
    assert window.count_labels(cut) == cached.count_labels(cut_cached)
    assert streamed_report.as_dict() == cached_report.as_dict()
