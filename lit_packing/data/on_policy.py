"""On-policy rollouts: the policy being trained answers the prompts, reward functions score the answers, and the
scored groups train it, round after round, packed as stored rollout groups are.

    data:
      source:
        class_path: lit_packing.data.OnPolicyRollouts
        init_args:
          prompts: {class_path: lit_packing.data.ArithmeticPrompts}   # any source with a `prompt` column
          group_size: 8                                               # completions per prompt (G)
          prompts_per_round: 8                                        # prompts each round samples, over all ranks
          reward_funcs: [lit_packing.models.rollouts.final_number]    # (prompts, completions, **columns) -> floats
          engine: lit_packing.models.engines.VLLMEngine               # vLLM, not generate (default GenerateEngine)

A round: the next `prompts_per_round` prompts (a seeded permutation of the prompt source, epoch after epoch), each
data-parallel rank sampling its share with the source's rollout `engine` (`models/engines.py`: G completions per
prompt and the sampler's log-probs of every token; `GenerateEngine`, transformers' `generate` on the policy itself,
or `VLLMEngine`, vLLM handed the policy's weights before each round), scored by the sum of the reward functions (each
called with the prompts, the completion texts and the prompt source's other columns, as TRL calls them; a None skips
that function for that completion, and a completion none scores is left out of its group: `round_scoring.py`); the
groups gathered from every rank, written by rank 0 to `<run folder>/rollouts/round_<k>.jsonl` (a stored-rollouts
file: `HFDataset` of it trains the same groups), tokenized and planned by the configured sampler as one dataset, and
trained `iterations` times (each pass a new plan; the stored log-probs are the behaviour policy's, so later passes
clip). Then the next round samples from the updated policy. Every round is whole optimizer steps (the last completed
with empty packs). The fit's `trainer.max_steps` bounds the rounds; without it (gpu.yaml's whole epoch) the fit is
one pass over the prompts, said at start.

Generation runs between optimizer steps, in the training process, by the policy the step before the round left. A
sharded policy (FSDP2, tensor parallel) runs each forward as a collective: every rank samples (its prompts, or none) in
step with the others (`rollouts.sample_groups`), and the old-log-probs pass runs every pack (context parallel is
refused). The round's rollout metrics (`round_stats`, TRL's meanings) are logged at each of its steps; training's
effective tokens/s counts the training steps only, the round's making being on `batch["round"]["clock"]`. Each batch
marks the completions cut at `max_new_tokens` (`batch["round"]["truncated"]`, for
`GRPO(mask_truncated_completions=True)`). The round's first step trains the policy that sampled it, and `GRPO` checks
there that the training forward scores the sampled tokens as the sampler did; past it, in half precision, the ratio's
old log-probs are the trainer's (`round_scoring.round_old_logps`, `batch["round"]["old_logps"]`, kept in the round's
file).

A checkpoint keeps the round and the micro-batch inside it: a resume reads the round's file back and samples the
next rounds from the restored policy, as the uninterrupted run would.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from lit_packing._compat import data_parallel
from lit_packing.batch import INDEX, ROUND, StepShape
from lit_packing.contract import DataContract, ModelContract, Policy
from lit_packing.data.feed import Feed, SamplerBuilder
from lit_packing.data.report import TokenizationReport
from lit_packing.data.round_scoring import (
    SETTING,
    gather_groups,
    import_reward,
    reward_names,
    round_old_logps,
    round_stats,
    scored_groups,
    sum_rewards,
    truncated_completions,
)
from lit_packing.data.sources import Source
from lit_packing.data.tokenize import TokenizedDataset, tokenize_dataset
from lit_packing.errors import ConfigError, DataError, check_range
from lit_packing.models.context import CP_SIZE_SETTING
from lit_packing.models.engines import GenerateEngine, RolloutEngine, SamplingSettings
from lit_packing.models.rollouts import end_of_sequence_ids
from lit_packing.samplers import PlannedBatchSampler
from lit_packing.samplers.base import Pack
from lit_packing.samplers.base import worst_pack as worst_pack_of

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)


class OnPolicyRollouts(Source):
    """Rollout groups sampled from the policy during the fit (see the module docstring).

    Args:
        prompts: the prompts: a source with a `prompt` column (a text, one user turn, or chat messages); its other
            columns go to the reward functions.
        group_size: completions per prompt (G).
        prompts_per_round: prompts sampled each round, over all data-parallel ranks.
        max_new_tokens: the generation limit of a completion (sampled at the objective's `temperature`).
        top_k: sample from the k likeliest tokens only (0: all of them).
        top_p: sample from the smallest set of tokens whose probability reaches p (1: all of them). Either cut
            decides what is drawn; the log-probs stored and trained are the policy's over the whole vocabulary at
            the objective's temperature (as TRL's), so the first step of a round has an importance ratio of 1.
        reward_funcs: import paths of reward functions, `(prompts, completions, **columns) -> list[float | None]`;
            a completion's reward is their sum over the functions that score it (None: not scored, TRL's nansum).
            A completion that no function scores is left out of its group (said in one line), so its group's
            baseline and std are those of the scored completions, as TRL's; a round with none scored stops the run.
        iterations: passes over each round's groups before the next round (TRL's `num_iterations`).
        generation_batch: prompts per `generate` call (x G sequences; vLLM batches its own).
        seed: the prompts' order and the sampling.
        engine: builds what samples the rounds from the policy and its tokenizer: `GenerateEngine`, or
            `VLLMEngine` with vLLM's settings, `{class_path: lit_packing.models.engines.VLLMEngine, init_args:
            {gpu_memory_utilization: 0.3}}` (`models/engines.py`).
    """

    def __init__(
        self,
        prompts: Source | None = None,
        group_size: int = 8,
        prompts_per_round: int = 8,
        max_new_tokens: int = 64,
        reward_funcs: list[str] | None = None,
        iterations: int = 1,
        generation_batch: int = 8,
        seed: int = 0,
        top_k: int = 0,
        top_p: float = 1.0,
        engine: Callable[[Any, Any], RolloutEngine] = GenerateEngine,
    ) -> None:
        from lit_packing.data.packaged import ArithmeticPrompts

        for name, value, low in (("group_size", group_size, 2), ("prompts_per_round", prompts_per_round, 1),
                                 ("max_new_tokens", max_new_tokens, 1), ("iterations", iterations, 1),
                                 ("generation_batch", generation_batch, 1), ("top_k", top_k, 0)):  # fmt: skip
            check_range(f"{SETTING}.{name}", value, low)
        check_range(f"{SETTING}.top_p", top_p, 0.0, 1.0, low_open=True)
        self.prompts = prompts if prompts is not None else ArithmeticPrompts()
        self.group_size = group_size
        self.prompts_per_round = prompts_per_round
        self.max_new_tokens = max_new_tokens
        self.reward_funcs = list(reward_funcs or ["lit_packing.models.rollouts.final_number"])
        for path in self.reward_funcs:
            import_reward(path)
        self.iterations = iterations
        self.generation_batch = generation_batch
        self.seed = seed
        self.top_k, self.top_p = top_k, top_p
        self.engine = engine

    def settings(self, temperature: float, seed: int) -> SamplingSettings:
        """A round's sampling settings at the objective's `temperature`, from `seed`."""
        return SamplingSettings(self.group_size, self.max_new_tokens, temperature, self.top_k, self.top_p, seed,
                                self.generation_batch)  # fmt: skip

    @property
    def fingerprint(self) -> str:
        return f"{type(self).__name__}-{self.prompts.fingerprint}"

    def load(self, cache_dir: str | None = None) -> datasets.Dataset:
        """The prompts (their source's `train` split where it has splits), checked for a `prompt` column."""
        loaded = self.prompts.load(cache_dir)
        if isinstance(loaded, datasets.DatasetDict):
            loaded = loaded["train"]
        if "prompt" not in loaded.column_names:
            raise ConfigError(f"{SETTING}.prompts", f"{self.prompts!r} has no 'prompt' column "
                              f"(columns: {', '.join(loaded.column_names)})", "map one with its field_map")  # fmt: skip
        return loaded

    def row_name(self, row: int) -> str:
        return self.prompts.row_name(row)


class OnPolicyFeed(Feed):
    """The feed of `OnPolicyRollouts`: the prompts loaded once, the groups made round by round (`RoundLoader`)."""

    def __init__(self, settings) -> None:
        super().__init__(settings)
        self.prompts: datasets.Dataset | None = None
        self.policy: Policy | None = None  # the model's (`connect_model`): what samples the rounds

    def connect_model(self, model: ModelContract) -> None:
        self.policy = model.policy

    @property
    def source(self) -> OnPolicyRollouts:
        return self.settings.source

    def prepare(self, tokenizer: Any) -> None:
        self.source.load(self.settings.cache_dir)

    def publish(self, stage: str | None, tokenizer: Any, trainer: pl.Trainer | None) -> DataContract:
        self.prompts = self.source.load(self.settings.cache_dir)
        if self.settings.limit is not None:
            self.prompts = self.prompts.select(range(min(self.settings.limit, len(self.prompts))))
        if self.settings.val_split:
            log.info("data.val_split=%s is not used: on-policy rounds hold nothing out (train/reward and "
                     "rollout/reward say how the policy does)", self.settings.val_split)  # fmt: skip
        if not len(self.prompts):
            raise DataError(f"{self.source.prompts!r} holds no prompts: check {SETTING}.prompts")
        self.report = TokenizationReport()  # every round's groups, as they are tokenized
        log.info("%r: on-policy rollouts from %s prompts, %s completions each, %s prompts a round",
                 self.source.prompts, f"{len(self.prompts):,}", self.source.group_size,
                 self.source.prompts_per_round)  # fmt: skip
        return DataContract(
            tokenizer=tokenizer,
            token_id_range=(0, len(tokenizer) - 1),  # what the policy can sample: nothing is sampled yet
            name_rows=lambda indices: "; ".join(f"group {int(i):,} of its round" for i in indices),
            largest_step=functools.partial(self.largest_step, tokenizer),
            report=self.report,
        )

    def train_loader(self, build: SamplerBuilder, tokenizer: Any, trainer: pl.Trainer | None) -> RoundLoader:
        if trainer is None:
            raise ConfigError("data.source", "on-policy rollouts are sampled by the model a fit trains",
                              "train with Trainer.fit (main.py fit)")  # fmt: skip
        rounds = None  # without a number of steps: one pass over the prompts, `trainer.max_epochs` 1
        if trainer.max_steps is None or trainer.max_steps < 0:
            if trainer.max_epochs != 1:
                raise ConfigError("trainer.max_steps", "on-policy rounds go on as long as the fit does, and "
                                  f"trainer.max_epochs={trainer.max_epochs} is not one pass over the prompts",
                                  "set the number of optimizer steps to train, or max_epochs: 1")  # fmt: skip
            rounds = -(-len(self.prompts) // self.source.prompts_per_round)
            log.warning("on-policy: trainer.max_steps is not set: one pass over the %s prompts, %s rounds of %s",
                        f"{len(self.prompts):,}", f"{rounds:,}", self.source.prompts_per_round)  # fmt: skip
        refuse_strategy(trainer.strategy)
        if self.settings.num_workers:  # e.g. gpu.yaml's 4 after grpo.yaml: said, not refused
            log.warning("on-policy: data.num_workers=%s is not used: rounds are sampled and collated in the "
                        "training process", self.settings.num_workers)  # fmt: skip
        if self.policy is None:
            raise ConfigError("model", "on-policy rounds are sampled by the model, and this one publishes no policy",
                              "train a lit_packing.models.PackedCausalLM")  # fmt: skip
        self.sampler = RoundLoader(self, build, tokenizer, trainer, rounds)
        self._apply_position()
        return self.sampler

    def largest_step(self, tokenizer: Any) -> StepShape | None:
        """The worst a round can plan: groups of `data.max_length` tokens in the sampler's declared `max_tokens`."""
        budget = self.settings.declared_max_tokens
        if self.sampler is None or not isinstance(budget, int):
            return None
        pack = worst_pack_of(0, min(self.settings.max_length, budget), budget)
        return self.collate(tokenizer).plan_slots(pack).largest()

    def position(self, trained: int | None) -> dict[str, Any]:
        return self.sampler.state_dict(trained)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if isinstance(self.sampler, RoundLoader):
            self.sampler.trained()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        stats = batch.get(ROUND, {}).get("stats") if isinstance(batch, dict) else None
        for name, value in (stats or {}).items():
            pl_module.log(f"rollout/{name}", float(value), on_step=True, on_epoch=False, batch_size=1)

    def on_train_end(self, trainer, pl_module) -> None:
        if isinstance(self.sampler, RoundLoader):
            self.sampler.engine.close()  # vLLM's memory back before anything runs after the fit

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)


class RoundLoader:
    """The training loader of on-policy rollouts: an endless iterable of collated micro-batches, round after round,
    with the position a checkpoint keeps (`state_dict(steps_done)` / `load_state_dict`)."""

    def __init__(self, feed: OnPolicyFeed, build: SamplerBuilder, tokenizer: Any, trainer: pl.Trainer,
                 rounds: int | None = None) -> None:  # fmt: skip
        self.feed, self.build, self.tokenizer, self.trainer = feed, build, tokenizer, trainer
        self.rounds = rounds  # the fit's rounds where no `max_steps` bounds it, else None
        self.source = feed.source
        self.collate = feed.collate(tokenizer)
        self.batch_sampler = self  # where Lightning's `set_epoch` reaches this loader
        self._starts: dict[int, int] = {}  # round -> its first micro-batch in the fit's count
        self._resume: dict[str, Any] | None = None
        self._handed_out = self._trained = 0
        self.clock = {"sampling_s": 0.0}  # this rank's seconds making rounds, read by the throughput callback
        self.reward_names = reward_names(self.source.reward_funcs)
        self.engine = self.source.engine(feed.policy.model, tokenizer)  # what samples the rounds
        self._sampled: tuple[int, tuple[list[dict], dict]] | None = None  # the last round sampled
        self.resumed_at: int | None = None
        self.restored: str | None = None

    def set_epoch(self, epoch: int) -> None:
        """Rounds go on across Lightning's epochs: nothing to do."""

    def __len__(self) -> int:
        raise TypeError(
            "on-policy rounds go on as long as the fit does (trainer.max_steps, or one pass over the prompts)"
        )

    @property
    def folder(self) -> Path:
        return Path(self.trainer.default_root_dir) / "rollouts"

    def round_file(self, number: int) -> Path:
        return self.folder / f"round_{number:06d}.jsonl"

    def __iter__(self) -> Iterator[dict[str, Any]]:
        resume = self._resume  # kept until a step trains: Lightning may start an iterator, then start another
        self._handed_out = self._trained = 0  # this iterator's batches handed out, and trained
        number, start, inside = (0, 0, 0) if resume is None else (resume["round"], resume["start"], resume["inside"])
        return self._batches(number, start, inside, resume is not None)

    def _batches(self, number: int, start: int, inside: int, resumed: bool) -> Iterator[dict[str, Any]]:
        accumulate = self.trainer.accumulate_grad_batches
        while self._more(number, start // accumulate):  # no round is sampled that no step would train
            first: dict[str, Any] | None = None
            if resumed:
                rows = self._read(number)
                stats = {"round": number, **round_stats(rows, self._ends())}
            else:
                # The policy that the step before the round leaves samples it. Where Lightning fetches a batch ahead
                # (a loader of unknown length), the last batch handed out is not trained yet: the round's first
                # batch is handed out empty and filled in place when the loop fetches the one after it.
                if self._handed_out > self._trained:
                    first = {}
                    self._handed_out += 1
                    yield first
                    if self._handed_out - 1 > self._trained:
                        raise RuntimeError("on-policy round sampled before the step before it trained: "
                                           "Lightning fetched more than one batch ahead")  # fmt: skip
                rows, stats = self._sample(number)
            dataset = self._tokenize(rows, number)
            plans = [self._plan(dataset, number, iteration) for iteration in range(self.source.iterations)]
            began, policy = time.perf_counter(), self.feed.policy
            old = round_old_logps(rows, dataset, plans[0], policy.model, policy.temperature, self.collate,
                                  self.trainer, self.source.iterations)  # fmt: skip
            self.clock["sampling_s"] += time.perf_counter() - began
            if not resumed and self.trainer.is_global_zero:
                self._write(number, rows)
            resumed = False
            self._starts = {**{k: v for k, v in self._starts.items() if k >= number - 2}, number: start}
            for iteration, packs in enumerate(plans):
                total = len(packs)
                for position in range(inside, len(packs)):
                    fresh = not iteration and position < accumulate  # the round's first step: the policy that sampled
                    batch = self._collate(dataset, packs[position], number, stats, fresh, old)
                    if first is not None:
                        first.update(batch)
                        first = None
                    else:
                        self._handed_out += 1
                        yield batch
                inside = max(inside - total, 0)
                start += total
            number += 1

    def _more(self, number: int, steps: int) -> bool:
        """Whether round `number` trains, `steps` optimizer steps into the fit."""
        return number < self.rounds if self.rounds is not None else steps < self.trainer.max_steps

    def _plan(self, dataset: TokenizedDataset, number: int, iteration: int) -> list[Pack]:
        """This rank's packs of one pass over round `number`, whole optimizer steps (the last completed with empty
        packs): a distinct plan for every pass of every round."""
        sampler = self.build(dataset.lengths, dataset.count_labels)
        if not isinstance(sampler, PlannedBatchSampler):
            raise ConfigError("data.sampler", f"{sampler!r} has no plan to train rounds with",
                              "use a lit_packing sampler")  # fmt: skip
        sampler.set_epoch((number << 16) | iteration)
        packs = list(sampler)
        accumulate = self.trainer.accumulate_grad_batches
        total = -(-len(packs) // accumulate) * accumulate
        return packs + [Pack([], step=packs[-1].step if packs else None)] * (total - len(packs))

    def _ends(self) -> list[int]:
        return end_of_sequence_ids(self.feed.policy.model, self.tokenizer)

    def _collate(self, dataset: TokenizedDataset, pack: Pack, number: int, stats: dict, fresh: bool,
                 old: dict[int, list[float]] | None = None) -> dict[str, Any]:  # fmt: skip
        items = Pack([dataset[key] for key in pack], step=pack.step)
        batch = self.collate(items)
        batch[ROUND] = {"number": number, "stats": stats, "clock": self.clock, "on_policy": fresh,
                        "truncated": truncated_completions(items, self._ends())}  # fmt: skip
        if old is not None and not fresh:  # past the first step: the trainer's log-probs of the policy that sampled
            batch[ROUND]["old_logps"] = [logp for item in items for logp in old[int(item[INDEX])]]
        return batch

    # ------------------------------------------------------------ one round

    def _prompts(self, number: int) -> list[int]:
        """The rows of round `number`'s prompts: positions of a seeded permutation of the prompts, epoch on epoch."""
        n, size = len(self.feed.prompts), self.source.prompts_per_round
        orders: dict[int, np.ndarray] = {}  # each epoch's permutation, drawn once (a round spans at most a few)
        rows = []
        for position in range(number * size, (number + 1) * size):
            epoch, at = divmod(position, n)
            if epoch not in orders:
                orders[epoch] = np.random.default_rng([self.source.seed, epoch]).permutation(n)
            rows.append(int(orders[epoch][at]))
        return rows

    def _sample(self, number: int) -> tuple[list[dict], dict[str, float]]:
        """Round `number`'s groups: this rank's share of its prompts sampled and scored, every rank's gathered."""
        if self._sampled is not None and self._sampled[0] == number:  # Lightning restarted its iterator: no resample
            return self._sampled[1]
        rank, world = data_parallel(self.trainer)
        rows = self._prompts(number)
        mine = rows[rank::world]
        policy = self.feed.policy  # the model's contract: the one way the data reaches the model
        source = self.source
        began = time.perf_counter()
        self.engine.update_weights(policy.model)  # the policy the step before the round left
        # Every rank samples, with no prompts too: a sharded policy's ranks step together (`rollouts.sample_groups`)
        prompts = self.feed.prompts.select(mine)
        columns = {name: prompts[name] for name in prompts.column_names if name != "prompt"}
        settings = source.settings(policy.temperature, seed=source.seed * 1_000_003 + number * 1_009 + rank)
        groups = [group.row() for group in self.engine.sample(prompts["prompt"], settings)]
        seconds = time.perf_counter() - began if mine else 0.0
        for k, (group, row) in enumerate(zip(groups, mine)):
            group["prompt_row"] = row
            group.update({name: values[k] for name, values in columns.items()})
        functions = [import_reward(path) for path in source.reward_funcs]
        sum_rewards(groups, dict(zip(self.reward_names, functions)), columns)
        generated = sum(len(c) for g in groups for c in g["completions"])
        gathered = gather_groups(scored_groups(groups, number), world)
        gathered.sort(key=lambda g: rows.index(g["prompt_row"]))
        if not gathered:  # every rank decides on the same gathered round
            raise DataError(f"on-policy round {number}: no reward function scored any completion (each returned None): "
                            f"check {SETTING}.reward_funcs and the prompts' columns they read (an answer that "
                            "does not parse), or raise prompts_per_round")  # fmt: skip
        out = [{k: v for k, v in g.items() if k not in ("texts", "function_rewards")} for g in gathered]  # stored rows
        advantages = policy.round_advantages(out)
        for row, values in zip(out, advantages or []):  # advantages of the whole round (`scale_rewards: batch`)
            row["advantages"] = values
        stats = {"round": number, **round_stats(gathered, self._ends(), self.reward_names), "generation_s": seconds,
                 "generated_tokens_per_s": generated / max(seconds, 1e-9)}  # fmt: skip
        self.clock["sampling_s"] += time.perf_counter() - began  # sampling, scoring, gathering: not training
        self._sampled = number, (out, stats)
        return out, stats

    def _write(self, number: int, rows: list[dict]) -> None:
        """Round `number`'s groups as a stored-rollouts file, written whole or not at all."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.round_file(number)
        partial = path.with_suffix(".partial")
        partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
        os.replace(partial, path)

    def _read(self, number: int) -> list[dict]:
        path = self.round_file(number)
        if not path.exists():
            raise DataError(f"resuming inside on-policy round {number}, whose rollouts {path} are gone: resume with "
                            "the run's folder as it was written (trainer.default_root_dir)")  # fmt: skip
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def _tokenize(self, rows: list[dict], number: int) -> TokenizedDataset:
        settings = self.feed.settings
        raw = datasets.Dataset.from_list(rows)
        tokenized, report = tokenize_dataset(
            raw, self.tokenizer, settings.max_length, settings.overlong, settings.train_on,
            on_bad_row=settings.on_bad_row, row_name=lambda r: f"group {r:,} of {self.round_file(number)}",
        )  # fmt: skip
        self.feed.report.update(report)
        return TokenizedDataset(tokenized)

    # ------------------------------------------------------------ resume

    def trained(self) -> None:
        """A batch trained: a restored position is behind, a new iterator starts where the fit is."""
        self._resume = None
        self._trained += 1

    def state_dict(self, steps_done: int | None = None) -> dict[str, Any]:
        """The trained position: the round holding micro-batch `steps_done` (Lightning's count) and how far in."""
        if steps_done is None:
            return {}
        if self._resume is not None:  # restored, nothing yielded yet: the same position
            return self._resume
        number = max((k for k, begin in self._starts.items() if begin <= steps_done), default=0)
        begin = self._starts.get(number, 0)
        world, accumulate = data_parallel(self.trainer).size, self.trainer.accumulate_grad_batches
        return {"on_policy": True, "round": number, "start": begin, "inside": steps_done - begin,
                "world_size": world, "accumulate": accumulate}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        if not state.get("on_policy"):
            raise ConfigError("data.source", "the checkpoint's data position is not an on-policy run's",
                              "resume with the data it was saved with, or start a new run")  # fmt: skip
        layout = (data_parallel(self.trainer).size, self.trainer.accumulate_grad_batches)
        if (state["world_size"], state["accumulate"]) != layout:
            raise ConfigError("trainer.devices", f"an on-policy round was planned for {state['world_size']} ranks "
                              f"x {state['accumulate']} micro-batches a step, this run has {layout[0]} x {layout[1]}",
                              "resume on the same layout")  # fmt: skip
        self._resume = dict(state)
        self.resumed_at = int(state["start"]) + int(state["inside"])
        self.restored = f"on-policy round {state['round']:,}, micro-batch {state['inside']:,} of it"


def refuse_strategy(strategy: Any) -> None:
    """A strategy whose ranks cannot each sample their prompts from the policy, refused in one line."""
    if getattr(strategy, "context_parallel_size", 1) > 1:
        raise ConfigError(CP_SIZE_SETTING, "on-policy rounds are sampled and scored by whole sequences on each rank, "
                          "and context parallel splits each one's tokens over its ranks", "set it to 1")  # fmt: skip
    if not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)):
        raise ConfigError("trainer.strategy", f"on-policy rollouts are not sampled under {type(strategy).__name__}",
                          "use ddp, fsdp2 (ShardedStrategy) or one device, or train on stored rollouts")  # fmt: skip
