"""The stream (`data.streaming`): the same examples as the cached path, every example once per pass over ranks and
workers, equal steps per rank, exact and elastic resume mid-window, token-exact mixtures, bad rows named by shard and
line, and a foreign position refused -- on real sources and the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from lit_packing.batch import INPUT_IDS, LABELS, ROWS, SOURCE_TOKENS
from lit_packing.data import Chatterbot, HFDataset, HumanEval, Mixture, PackedCollator, PackingDataModule
from lit_packing.data.global_batch import Layout
from lit_packing.data.stream import (
    Interleaver,
    InterleaveState,
    Stream,
    StreamLoader,
    TokenizeRules,
    example_id,
    split_id,
)
from lit_packing.errors import ConfigError, DataError
from lit_packing.samplers import BestFitPackingSampler, MultipackSampler, RunContext

SEED = 5


def stream_of(source, tokenizer, buffer_size=64, num_workers=0, on_bad_row="error", held=None) -> Stream:
    rules = TokenizeRules(tokenizer, max_length=256, overlong="truncate", train_on="completion", on_bad_row=on_bad_row)
    return Stream(source, rules, buffer_size, SEED, num_workers=num_workers, held=held)


def loader(stream, rank=0, world_size=1, accumulate=1, factory=BestFitPackingSampler, max_tokens=512):
    def make(window):
        sampler = factory(window.lengths, max_tokens=max_tokens, rank=rank, world_size=world_size)
        return sampler.connect(RunContext(seed=SEED, accumulate=accumulate, label_counter=window.count_labels))

    return StreamLoader(stream, make, PackedCollator(0), lambda: Layout(world_size, accumulate))


def examples(batches) -> list[int]:
    return [row for batch in batches for row in batch[ROWS]]


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def test_the_stream_holds_the_cached_paths_examples(tokenizer, tmp_path):
    """Chatterbot streamed (windows of 64, two workers) and cached: the same token and label sequences, and the
    same counts of what tokenization kept and cut."""
    cached = PackingDataModule(source=Chatterbot(), val_split=0, max_length=256, cache_dir=str(tmp_path))
    cached.setup("fit")
    table = cached.train_dataset.dataset.with_format(None)
    expected = Counter((tuple(x), tuple(y)) for x, y in zip(table[INPUT_IDS], table[LABELS]))
    interleaver = Interleaver(
        stream_of(Chatterbot(), tokenizer, num_workers=2), epoch=0, state=InterleaveState.start(1)
    )
    seen = Counter()
    while (window := interleaver.window(0)) is not None:
        seen.update((tuple(x.tolist()), tuple(y.tolist())) for x, y in zip(window.tokens, window.labels))
    assert seen == expected
    streamed, whole = interleaver.report.as_dict(), cached.report.as_dict()
    streamed.pop("duplicate_examples"), whole.pop("duplicate_examples")  # a stream counts them within a chunk
    assert streamed == whole


@pytest.mark.parametrize("accumulate", [1, 2])
def test_every_example_once_over_ranks_and_workers_with_equal_steps(tokenizer, accumulate):
    stream = stream_of(Chatterbot(), tokenizer, buffer_size=50, num_workers=2)
    per_rank = [
        list(loader(stream, rank=r, world_size=2, accumulate=accumulate, factory=MultipackSampler)) for r in (0, 1)
    ]
    assert len(per_rank[0]) == len(per_rank[1]) and len(per_rank[0]) % accumulate == 0
    trained = Counter(examples(per_rank[0]) + examples(per_rank[1]))
    assert set(trained.values()) == {1}
    alone = Counter(examples(loader(stream_of(Chatterbot(), tokenizer, buffer_size=50))))
    assert trained == alone  # the same examples as one rank, each once


@pytest.mark.parametrize("old, new", [((1, 1), (1, 1)), ((2, 1), (1, 2)), ((1, 2), (2, 1)), ((2, 1), (1, 1))])
def test_resume_mid_window_exact_and_elastic(tokenizer, old, new):
    """Stopped after k micro-batches (a step boundary), resumed on the same or another layout: the rest of the
    pass, every example once; on the same global batch the same optimizer steps as the uninterrupted run."""
    stream = stream_of(Chatterbot(), tokenizer, buffer_size=80, num_workers=1)

    def run(layout, state=None):
        loaders = [loader(stream, r, *layout) for r in range(layout[0])]
        if state is not None:
            for one in loaders:
                one.load_state_dict(state)
        return loaders, [list(one) for one in loaders]

    loaders, full = run(old)
    steps = len(full[0]) // old[1]
    k = (steps // 2 + 1) * old[1]  # inside the second window or later
    first, _ = run(old)
    taken = [list(next_n(iter(one), k)) for one in first]
    state = first[0].state_dict(steps_done=k)
    assert state["window"] >= 1
    resumed_loaders, rest = run(new, state)
    assert resumed_loaders[0].resumed_at == k // old[1] * new[1]
    trained = Counter(examples(sum(taken, [])) + examples(sum(rest, [])))
    assert set(trained.values()) == {1} and trained == Counter(examples(sum(full, [])))
    if old[0] * old[1] == new[0] * new[1]:  # the same global batch: the same optimizer steps
        assert optimizer_steps(rest, new[1]) == optimizer_steps(full, old[1])[k // old[1] :]


def next_n(iterator, n):
    for _ in range(n):
        yield next(iterator)


def optimizer_steps(per_rank: list[list[dict]], accumulate: int) -> list[list[int]]:
    n = len(per_rank[0])
    return [
        sorted(examples([b for rank in per_rank for b in rank[g : g + accumulate]])) for g in range(0, n, accumulate)
    ]


def test_mixture_shares_follow_the_weights_in_every_window(tokenizer):
    """Chatterbot's short chats and HumanEval's long code completions, 30/70 by real tokens: every window's share
    within 2% (one example of either is up to ~1% of a window here); the epoch stops when HumanEval runs out."""
    mixture = Mixture([Chatterbot(), HumanEval()], weights=[0.3, 0.7], names=["chat", "code"])
    stream = stream_of(mixture, tokenizer, buffer_size=100)
    windows: dict[int, Counter] = {}
    for batch in loader(stream, max_tokens=4096):
        windows.setdefault(batch["window"]["number"], Counter()).update(dict(enumerate(batch[SOURCE_TOKENS])))
    assert len(windows) >= 3
    for number, tokens in sorted(windows.items())[:-1]:  # the last window holds what the stop left
        assert tokens[0] / (tokens[0] + tokens[1]) == pytest.approx(0.3, abs=0.02), f"window {number}"
    whole = sum(windows.values(), Counter())
    assert whole[0] / (whole[0] + whole[1]) == pytest.approx(0.3, abs=0.01)


def test_a_bad_line_mid_stream_is_named_by_file_and_line(tokenizer, tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    for name, lines in (("a.jsonl", 30), ("b.jsonl", 30)):
        rows = [json.dumps(chat)] * lines
        if name == "b.jsonl":
            rows[17] = '{"messages": [oops'
        (folder / name).write_text("\n".join(rows) + "\n")
    source = HFDataset("json", data_files=str(folder / "*.jsonl"))
    with pytest.raises(DataError, match=r"line 18 of .*b\.jsonl"):
        list(loader(stream_of(source, tokenizer, buffer_size=16)))
    skipping = loader(stream_of(source, tokenizer, buffer_size=16, on_bad_row="skip"))
    assert len(examples(list(skipping))) == 59
    assert skipping.interleaver.report.bad_examples == 1


def test_a_position_of_another_stream_is_refused(tokenizer):
    state = loader(stream_of(Chatterbot(), tokenizer, buffer_size=64)).state_dict(steps_done=0)
    for other, setting in ((stream_of(Chatterbot(), tokenizer, buffer_size=32), "data.buffer_size"),
                           (stream_of(HumanEval(), tokenizer, buffer_size=64), "data.source")):  # fmt: skip
        with pytest.raises(ConfigError, match=f"^{setting}: the checkpoint's stream position was saved with another"):
            loader(other).load_state_dict(state)


def test_example_ids_name_their_source_shard_and_row(tokenizer):
    stream = stream_of(Mixture([Chatterbot(), HumanEval()]), tokenizer, buffer_size=64)
    rows = examples(next_n(iter(loader(stream)), 5))
    assert {split_id(r)[0] for r in rows} <= {0, 1}
    assert all(stream.name_example(r).startswith("row ") for r in rows)


def test_limit_reads_each_sources_first_rows(tokenizer):
    """`data.limit` with a stream: each source's first rows, in file order, every epoch the same ones."""
    rules = TokenizeRules(tokenizer, max_length=256, overlong="truncate", train_on="completion", on_bad_row="error")
    stream = Stream(Chatterbot(), rules, 16, SEED, limit=30)
    ids = examples(loader(stream, max_tokens=4096))
    assert sorted(ids) == [example_id(0, 0, r) for r in range(30)]
    again = loader(stream, max_tokens=4096)
    again.set_epoch(1)
    assert sorted(examples(again)) == sorted(ids)
    mixed = Stream(Mixture([Chatterbot(), HumanEval()], on_exhausted="repeat"), rules, 16, SEED, limit=10)
    assert {split_id(i)[2] for i in examples(loader(mixed, max_tokens=4096))} <= set(range(10))
