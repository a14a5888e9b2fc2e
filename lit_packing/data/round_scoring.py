"""What a sampled round is scored with, and what is measured of it: the reward functions (`import_reward`,
`sum_rewards`), the completions no function scored (`scored_groups`), the round's rollout metrics (`round_stats`,
TRL's meanings), the completions cut at the generation limit (`truncated_completions`), and the old log-probs pass
(`round_old_logps`, `trainer_logps`).

    stats = round_stats(scored_groups(groups, number=0), ends=[2], names=["final_number"])

The ratio's old log-probs are the trainer's, not the sampler's: the first step's training forward has them; where a
round trains past its first step (`iterations` > 1, or more groups than one step takes) in half precision, where the
sampler and the training forward round differently, one no-grad pass of the policy that sampled, before the first
step, computes them for every group (`trainer_logps`, kept in the round's file as `old_logps`). At full precision the
sampler's are the trainer's to rounding (the self-test holds them to it) and no pass runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from lit_packing._compat import data_parallel
from lit_packing.batch import COMPLETION_TOKENS, INDEX, INPUT_IDS
from lit_packing.errors import ConfigError, install_hint

if TYPE_CHECKING:
    import lightning.pytorch as pl

log = logging.getLogger(__name__)

SETTING = "data.source.init_args"  # where the on-policy source is configured


def import_reward(path: str) -> Callable[..., list[float]]:
    """The reward function at `path` (`package.module.function`), or a `ConfigError` naming it."""
    module, _, name = path.rpartition(".")
    try:
        function = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        function = None
    if not callable(function):
        raise ConfigError(f"{SETTING}.reward_funcs", f"{path!r} is not an importable function",
                          "give its import path, e.g. lit_packing.models.rollouts.final_number")  # fmt: skip
    module, extra = getattr(function, "requires", (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        raise ConfigError(f"{SETTING}.reward_funcs", f"{path} needs the {module} package",
                          install_hint(extra))  # fmt: skip
    return function


def reward_names(paths: list[str]) -> list[str]:
    """The name each reward function is logged under (`rollout/rewards/<name>/mean`): its function name, as TRL
    names it, or its whole import path where two share one.

    >>> reward_names(["a.final_number", "b.format", "c.format"])
    ['final_number', 'b.format', 'c.format']
    """
    short = [path.rpartition(".")[2] for path in paths]
    return [name if short.count(name) == 1 else path for name, path in zip(short, paths)]


def truncated_completions(items: list[dict], ends: list[int]) -> list[bool]:
    """Per completion of a batch's group items (in the batch's order), whether it stopped at the generation limit:
    its last token is none of the `ends` that end a completion (TRL's test for `mask_truncated_completions`). A
    prompt [5, 6] and completions [7, 2] (ended by 2) and [8, 9]:

    >>> truncated_completions([{"input_ids": [5, 6, 7, 2, 8, 9], "completion_tokens": [2, 2]}], ends=[2])
    [False, True]
    """
    flags = []
    for item in items:
        ids, sizes = item[INPUT_IDS], item.get(COMPLETION_TOKENS) or []
        last = len(ids) - sum(sizes) + np.cumsum(sizes) - 1  # each completion's last token
        flags.extend(bool(int(ids[i]) not in ends) for i in last)
    return flags


def scored_groups(groups: list[dict], number: int) -> list[dict]:
    """The groups without their completions that no reward function scored (reward NaN), said in one line; a group
    left with none is left out. TRL keeps such a completion out of its group's mean and std and gives it no
    advantage: here it is not trained at all."""
    kept, dropped = [], 0
    per_completion = ("completions", "texts", "behaviour_logps", "rewards", "function_rewards")
    for group in groups:
        scored = [not np.isnan(r) for r in group["rewards"]]
        dropped += scored.count(False)
        if all(scored):
            kept.append(group)
        elif any(scored):
            kept.append({**group, **{key: [v for v, s in zip(group[key], scored) if s] for key in per_completion}})
    if dropped:
        total = sum(len(group["rewards"]) for group in groups)
        log.warning("on-policy round %s: %s of %s completions were scored by no reward function (each returned None):"
                    " left out of their groups (%s groups left of %s)", number, dropped, total,
                    len(kept), len(groups))  # fmt: skip
    return kept


def sum_rewards(groups: list[dict], functions: dict[str, Callable[..., list]], columns: dict[str, list]) -> None:
    """Score each group's completions with every reward function (by name): `function_rewards` (per completion,
    each function's reward, NaN where it returned None) and `rewards`, their sum over the functions that score it
    (TRL's nansum), NaN where none does."""
    from lit_packing.models.rollouts import score_groups

    scores = []  # per function, per group: (G,) with NaN where it scores nothing
    for function in functions.values():
        score_groups(groups, function, **columns)
        scores.append([np.asarray(group["rewards"], dtype=np.float64) for group in groups])
    for k, group in enumerate(groups):
        table = np.stack([function[k] for function in scores])  # (functions, G)
        unscored = np.isnan(table).all(axis=0)
        group["function_rewards"] = table.T.tolist()
        group["rewards"] = np.where(unscored, np.nan, np.nansum(table, axis=0)).tolist()


def _std(values: np.ndarray) -> float:
    """The sample std (n - 1, as TRL's `nanstd`); 0 for fewer than two values."""
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def round_stats(groups: list[dict], ends: list[int], names: list[str] | None = None) -> dict[str, float]:
    """A round's rollout metrics, TRL's meanings, over every rank's scored groups: `reward` and `reward_std` over
    its completions, `frac_reward_zero_std` (the share of groups whose rewards are all equal: no advantage, no
    gradient), `clipped_ratio` (the share of completions whose last token ends none: cut at `max_new_tokens`), and
    where the groups carry `function_rewards`, each named function's `rewards/<name>/mean` and `/std` over the
    completions it scored (none scored: not logged). Groups [1, 1] and [0, 2] of one function `f`, every completion
    ended by 2:

    >>> groups = [{"rewards": [1.0, 1.0], "completions": [[7, 2], [2]], "function_rewards": [[1.0], [1.0]]},
    ...           {"rewards": [0.0, 2.0], "completions": [[2], [8, 2]], "function_rewards": [[0.0], [2.0]]}]
    >>> {name: round(value, 4) for name, value in round_stats(groups, ends=[2], names=["f"]).items()}
    {'reward': 1.0, 'reward_std': 0.8165, 'frac_reward_zero_std': 0.5, 'clipped_ratio': 0.0, 'rewards/f/mean': 1.0, \
'rewards/f/std': 0.8165}
    """
    rewards = np.array([r for group in groups for r in group["rewards"]], dtype=np.float64)
    uniform = [max(group["rewards"]) == min(group["rewards"]) for group in groups]  # all equal: zero std
    truncated = [completion[-1] not in ends for group in groups for completion in group["completions"]]
    stats = {"reward": float(np.mean(rewards)), "reward_std": _std(rewards),
             "frac_reward_zero_std": float(np.mean(uniform)), "clipped_ratio": float(np.mean(truncated))}  # fmt: skip
    if names and groups and all("function_rewards" in group for group in groups):
        table = np.array([r for group in groups for r in group["function_rewards"]], dtype=np.float64)  # (C, F)
        for name, column in zip(names, table.T):
            scored = column[~np.isnan(column)]
            if len(scored):
                stats[f"rewards/{name}/mean"], stats[f"rewards/{name}/std"] = float(scored.mean()), _std(scored)
    return stats


def trainer_logps(model, packs: list[list[dict]], collate: Callable, temperature: float, context: Callable,
                  to_device: Callable) -> dict[int, list[float]]:  # fmt: skip
    """Each group's completion-token log-probs (flat, by its item's `index`) under `model`'s forward as the training
    step computes them (packs collated by `collate`, moved by `to_device`, the chunked head, logits /
    `temperature`, under the trainer's precision `context()`), no gradient, in eval mode. One forward per pack, an
    empty pack's included (one masked token): a sharded model's forwards are collectives, and every rank's plan has
    as many packs as the others', so every rank runs as many forwards; its gathered parameters are freed after."""
    from lit_packing.models.grpo import completion_logps
    from lit_packing.models.head import head_inputs
    from lit_packing.models.sharding import reshard

    found: dict[int, list[float]] = {}
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), context():
            for items in packs:
                batch = to_device(collate(items))
                logps = completion_logps(head_inputs(model, batch), batch, temperature).logps.tolist()
                start = 0
                for item in items:
                    n = int(sum(item[COMPLETION_TOKENS]))
                    found[int(item[INDEX])] = [round(x, 6) for x in logps[start : start + n]]  # as the sampler's
                    start += n
    finally:
        model.train(was_training)
    reshard(model)  # no backward follows: the root's parameters, gathered in the first forward, freed
    return found


def round_old_logps(rows: list[dict], dataset, plan: list, model, temperature: float, collate: Callable,
                    trainer: pl.Trainer, iterations: int) -> dict[int, list[float]] | None:  # fmt: skip
    """Each group's completion-token log-probs (flat, by its row in the round) by the training forward of the
    policy that sampled, where the round trains past its first step in half precision; None elsewhere.

    One no-grad pass (`trainer_logps`) over this rank's packs of the round's first `plan` (items of `dataset`),
    before the round's first step, gathered from every rank and kept in the rows (`old_logps`, one list per
    completion, written with the round): a resumed round reads them back."""
    from lit_packing.models.objectives import FULL_PRECISION

    if str(trainer.precision) in FULL_PRECISION:
        return None
    if any("old_logps" in row for row in rows):  # computed before (a restarted iterator) or read back
        return {k: [x for c in row["old_logps"] for x in c] for k, row in enumerate(rows) if "old_logps" in row}
    if iterations == 1 and len(plan) <= trainer.accumulate_grad_batches:
        return None  # the first step trains every group: its own forward has them
    mine = trainer_logps(model, [[dataset[key] for key in pack] for pack in plan], collate, temperature,
                         trainer.precision_plugin.forward_context, trainer.strategy.batch_to_device)  # fmt: skip
    found: dict[int, list[float]] = {}
    for part in gather_groups([mine], data_parallel(trainer).size):
        found.update(part)
    for k, row in enumerate(rows):
        if k in found:
            ends = np.cumsum([len(c) for c in row["completions"]]).tolist()
            row["old_logps"] = [found[k][a:b] for a, b in zip([0, *ends[:-1]], ends)]
    return found


def gather_groups(groups: list, world: int) -> list:
    """Every one of the `world` data-parallel ranks' groups, on every rank (one object collective that every rank
    reaches at each round). A tensor-parallel rank holds its data-parallel rank's groups, as its peers do: Lightning's
    mesh puts the data-parallel dim outermost, so the peers are consecutive ranks, and the first one's are kept."""
    if world == 1 or not torch.distributed.is_initialized():
        return list(groups)
    gathered: list[list | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, groups)
    return [group for part in gathered[:: len(gathered) // world] for group in (part or [])]
