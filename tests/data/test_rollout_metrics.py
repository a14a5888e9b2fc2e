"""A round's rollout metrics (`data/on_policy.py`: `sum_rewards`, `scored_groups`, `round_stats`), TRL's names and
meanings: a hand-worked round with exact values, and TRL's own generation batch on the same completions and reward
functions (`tests/helpers/trl_generation.py`) logging the same numbers."""

from __future__ import annotations

import math

import pytest

from lit_packing.data.on_policy import reward_names, round_stats, scored_groups, sum_rewards

END = 2  # the end-of-sequence id
# Three groups of a round: per completion (token ids, f1's reward, f2's reward); None: not scored.
ROUND = [
    [([5, END], 1.0, None), ([6, 7], 1.0, None), ([8], 1.0, None)],
    [([9], 0.0, 0.5), ([10, END], 2.0, None), ([11], 1.0, 0.5)],
    [([12], 2.0, None), ([13], 0.0, 1.0), ([14, 15], 0.0, None)],
]


def reward_of(column: int):
    """Our reward function of column 1 (f1) or 2 (f2): by the completion's text (its ids, written out)."""
    table = {str(c[0]): c[column] for group in ROUND for c in group}
    return lambda prompts, completions, **columns: [table[text] for text in completions]


def trl_reward_of(column: int):
    """The same for TRL, which hands a reward function the completions' token ids."""
    table = {tuple(c[0]): c[column] for group in ROUND for c in group}
    return lambda prompts, completions, completion_ids, **kw: [table[tuple(ids)] for ids in completion_ids]


def groups_of(round_):
    return [{"prompt": f"q{k}", "completions": [c[0] for c in group], "texts": [str(c[0]) for c in group],
             "behaviour_logps": [[-1.0] * len(c[0]) for c in group]} for k, group in enumerate(round_)]  # fmt: skip


def test_a_rounds_metrics_are_exact_on_a_hand_worked_round():
    """Rewards per completion (f1 + f2 where scored): [1, 1, 1], [0.5, 2, 1.5], [2, 1, 0], and a fourth completion
    of the last group that neither function scores (left out of its group and of every metric)."""
    unscored = [*ROUND[:2], [*ROUND[2], ([16], None, None)]]
    groups = groups_of(unscored)
    table = {str(c[0]): c for group in unscored for c in group}
    f1 = lambda prompts, completions, **kw: [table[t][1] for t in completions]  # noqa: E731
    f2 = lambda prompts, completions, **kw: [table[t][2] for t in completions]  # noqa: E731
    sum_rewards(groups, {"f1": f1, "f2": f2}, columns={})
    assert [g["rewards"] for g in groups][:2] == [[1.0, 1.0, 1.0], [0.5, 2.0, 1.5]]
    assert groups[2]["rewards"][:3] == [2.0, 1.0, 0.0] and math.isnan(groups[2]["rewards"][3])
    kept = scored_groups(groups, number=0)
    assert [len(g["completions"]) for g in kept] == [3, 3, 3] and len(kept[2]["function_rewards"]) == 3
    stats = round_stats(kept, ends=[END], names=["f1", "f2"])
    assert stats == pytest.approx(
        {
            "reward": 10 / 9,  # (3 + 4 + 3) / 9
            "reward_std": math.sqrt(61 / 144),  # sum of squared deviations 1098/324, over n - 1 = 8
            "frac_reward_zero_std": 1 / 3,  # the first group: all 1
            "clipped_ratio": 7 / 9,  # two of nine end with END
            "rewards/f1/mean": 8 / 9,  # over all nine
            "rewards/f1/std": math.sqrt(11 / 18),  # (4 x (1/9)^2 + 3 x (8/9)^2 + 2 x (10/9)^2) / 8
            "rewards/f2/mean": 2 / 3,  # over the three it scored: 0.5, 0.5, 1
            "rewards/f2/std": math.sqrt(1 / 12),
        },
        rel=1e-12,
    )
    assert round_stats(kept, ends=[END]).keys() == {"reward", "reward_std", "frac_reward_zero_std", "clipped_ratio"}


def test_a_function_that_scores_nothing_logs_no_mean_and_names_stay_apart():
    groups = groups_of(ROUND)
    sum_rewards(groups, {"f1": reward_of(1), "none": lambda prompts, completions, **kw: [None] * 3}, columns={})
    logged = {"reward", "reward_std", "frac_reward_zero_std", "clipped_ratio", "rewards/f1/mean", "rewards/f1/std"}
    assert set(round_stats(groups, [END], ["f1", "none"])) == logged
    assert reward_names(["pkg.a.score", "pkg.b.score", "pkg.c.length"]) == ["pkg.a.score", "pkg.b.score", "length"]


def test_a_rounds_metrics_are_what_trl_logs_for_the_same_generation_batch():
    """TRL's `_generate_and_score_completions` on the same completions and reward functions (G = 3): its
    `reward`, `reward_std`, `frac_reward_zero_std`, `rewards/<name>/mean` and `/std` and `completions/clipped_ratio`
    (TRL keeps rewards in float32: 1e-6)."""
    from tests.helpers import TINY_LLAMA, tiny_model
    from tests.helpers.trl_generation import trl_generation_batch

    completions = [c[0] for group in ROUND for c in group]
    prompts = [[20 + k] * 5 for k, group in enumerate(ROUND) for _ in group]
    model = tiny_model(dict(TINY_LLAMA, vocab_size=512), seed=0).double()
    functions = {"f1": trl_reward_of(1), "f2": trl_reward_of(2)}
    _, _, trl = trl_generation_batch(model, prompts, completions, [[-1.0] * len(c) for c in completions], functions,
                                     group_size=3)  # fmt: skip
    groups = groups_of(ROUND)
    sum_rewards(groups, {"f1": reward_of(1), "f2": reward_of(2)}, columns={})
    ours = round_stats(scored_groups(groups, 0), ends=[END], names=["f1", "f2"])
    assert trl["completions/clipped_ratio"] == pytest.approx(ours["clipped_ratio"], rel=1e-6)
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/f1/mean", "rewards/f1/std",
                 "rewards/f2/mean", "rewards/f2/std"):  # fmt: skip
        assert trl[name] == pytest.approx(ours[name], rel=1e-6), name
