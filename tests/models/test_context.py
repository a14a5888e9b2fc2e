"""Context parallelism (`lit_packing.models.context`): the deal of a pack's tokens over the ranks as properties
against an oracle, the refusals in one line, and (slow tier, CPU ranks over gloo, fp64) every backend's logits,
loss and gradients against one process on the same pack, with the leakage probe."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.batch import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    GATHERED_INDEX,
    IGNORE_INDEX,
    INPUT_IDS,
    KEY_INDEX,
    LABELS,
    POSITION_IDS,
)
from lit_packing.data.collate import PackedCollator, PairCollator
from lit_packing.errors import ConfigError
from lit_packing.models.context import (
    CP_SIZE_SETTING,
    check_context_parallel,
    check_dealable,
    deal,
    deal_of,
    plan,
    spread,
)
from lit_packing.strategies import ShardedStrategy
from tests.helpers import launch, make_examples
from tests.models.families import tiny_config
from tests.models.test_preference import make_pairs

ROOT = Path(__file__).resolve().parents[2]
RANKS = ROOT / "tests" / "helpers" / "context_ranks.py"
PACKS = {
    "mixed": [1, 3, 37, 2, 1, 64, 5, 20, 7],
    "one long": [200],
    "one-token documents": [1] * 9,
    "shorter than 2 x cp": [3, 2, 7, 1],
    "empty": [],
}


def packed(lengths: list[int], pad_to: int | None = 16) -> dict:
    return PackedCollator(pad_to_multiple_of=pad_to)(make_examples(lengths, seed=1)) if lengths else \
        PackedCollator()([])  # fmt: skip


def oracle(cu: list[int], size: int, rank: int) -> tuple[list[int], list[int], list[int]]:
    """Rank `rank`'s tokens and its pieces' query and key lengths, by the rule in words: a document of 2 x size
    tokens or more in 2 x size near-equal chunks (rank r: chunks r and 2 x size - 1 - r), each shorter one whole to
    the rank holding the fewest tokens so far (the lowest such rank)."""
    held, tokens, q, k = [0] * size, [], [], []
    for start, stop in zip(cu[:-1], cu[1:]):
        n = stop - start
        if n >= 2 * size:
            bounds = [start + (n * c) // (2 * size) for c in range(2 * size + 1)]
            for r in range(size):
                held[r] += sum(bounds[c + 1] - bounds[c] for c in (r, 2 * size - 1 - r))
            for c in sorted({rank, 2 * size - 1 - rank}):
                tokens += range(bounds[c], bounds[c + 1])
                q.append(bounds[c + 1] - bounds[c])
                k.append(bounds[c + 1] - start)
        elif n:
            owner = int(np.argmin(held))
            held[owner] += n
            if owner == rank:
                tokens += range(start, stop)
                q.append(n)
                k.append(n)
    return tokens, q, k


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("pack", list(PACKS))
def test_each_token_is_dealt_once_and_comes_back_in_place(pack, size):
    batch = packed(PACKS[pack])
    cu = batch[CU_SEQ_LENS_Q].tolist()
    total = batch[INPUT_IDS].shape[1]
    dealt = deal_of(plan(cu, size))
    owned = np.concatenate(dealt.tokens)
    assert sorted(owned.tolist()) == list(range(total))  # every token, once
    rows = []
    for rank in range(size):
        local = deal(batch, size, rank)
        assert local[INPUT_IDS].shape[1] == dealt.slots  # one row length on every rank, padding after
        tokens, q, k = oracle(cu, size, rank)
        assert dealt.tokens[rank].tolist() == tokens
        pad = dealt.slots - len(tokens)
        assert torch.diff(local[CU_SEQ_LENS_Q]).tolist() == [*q, pad]
        assert torch.diff(local[CU_SEQ_LENS_K]).tolist() == [*k, pad]
        assert len(local[GATHERED_INDEX]) == int(local[CU_SEQ_LENS_K][-1]) and KEY_INDEX not in local
        rows.append(torch.stack([local[INPUT_IDS][0], local[POSITION_IDS][0]], dim=1))
    assert torch.equal(dealt.undeal(rows), torch.stack([batch[INPUT_IDS][0], batch[POSITION_IDS][0]], dim=1))


@pytest.mark.parametrize("size", [2, 4])
def test_every_label_is_its_own_documents_next_token_and_counted_once(size):
    batch = packed(PACKS["mixed"])
    cu = batch[CU_SEQ_LENS_Q].tolist()
    labels = batch[LABELS][0]
    document = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    dealt, counted = deal_of(plan(cu, size)), 0
    for rank in range(size):
        local = deal(batch, size, rank)
        held = torch.from_numpy(dealt.tokens[rank])
        targets = local[LABELS][0, 1 : 1 + len(held)]  # the loss reads label t + 1 for the token at t
        assert torch.equal(local[LABELS][0, 1 + len(held) :], torch.full_like(local[LABELS][0, 1 + len(held) :], -100))
        for token, target in zip(held.tolist(), targets.tolist()):
            last = token + 1 == len(labels) or document[token + 1] != document[token]
            assert target == (IGNORE_INDEX if last else int(labels[token + 1]))  # never the next document's
        counted += int((targets != IGNORE_INDEX).sum())
    assert counted == int((labels[1:] != IGNORE_INDEX).sum())


@pytest.mark.parametrize("size", [2, 4])
def test_a_pieces_keys_are_its_documents_from_the_start_up_to_its_last_token(size):
    """Through the all-gather's layout (rank-major rows): `key_index` names, for each piece, its document's first
    token up to the piece's last, in order."""
    batch = packed(PACKS["mixed"])
    cu = batch[CU_SEQ_LENS_Q].tolist()
    pieces, dealt = plan(cu, size), deal_of(plan(cu, size))
    gathered = np.concatenate([np.concatenate([t, np.full(dealt.slots - len(t), -1)]) for t in dealt.tokens])
    for rank in range(size):
        local = deal(batch, size, rank)
        keys = gathered[local[GATHERED_INDEX].numpy()]
        cu_k = local[CU_SEQ_LENS_K].tolist()
        for (start, _, stop), a, b in zip(pieces[rank], cu_k[:-2], cu_k[1:-1]):
            assert keys[a:b].tolist() == list(range(start, stop))
        assert (keys[cu_k[-2] :] == -1).all()  # the padding attends the padding alone


def test_head_and_tail_balance_causal_pairs_on_a_long_document():
    """One document of 4,096 tokens on 4 ranks: tokens even within 1, causal pairs within 0.1%, where cutting it
    in 4 contiguous blocks gives the last rank 7x the first's pairs."""
    tokens, pairs = spread([0, 4096], 4)
    assert tokens == pytest.approx(1.0, abs=1e-3) and pairs < 1.001
    blocks = [sum(range(a + 1, a + 1025)) for a in range(0, 4096, 1024)]
    assert max(blocks) / np.mean(blocks) > 1.7  # what contiguous blocks would do


def test_a_padded_or_shared_prompt_batch_is_refused_in_one_line():
    shared = PairCollator(share_prompt=True)(make_pairs()[:2])
    with pytest.raises(ConfigError, match="share_prompt.*shared prompts are not split"):
        check_dealable(shared)
    padded = {INPUT_IDS: torch.ones(2, 5, dtype=torch.long)}
    with pytest.raises(ConfigError, match="splits packed rows"):
        check_dealable(padded)
    check_dealable(packed([4, 5]))


@pytest.mark.parametrize(
    "settings, problem",
    [
        ({"objective": "dpo"}, "preference pairs"),
        ({"loss_normalization": "sequence"}, "a document's mean loss would span ranks"),
        ({"compile": True}, "not measured"),
    ],
)
def test_what_cannot_split_is_refused_in_one_line_naming_the_setting(settings, problem):
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("llama")))
    with pytest.raises(ConfigError, match=problem) as error:
        check_context_parallel(2, model, False, settings)
    assert CP_SIZE_SETTING in str(error.value) and "\n" not in str(error.value)
    check_context_parallel(1, model, False, settings)  # size 1: nothing split, nothing refused


def test_a_state_space_mixer_or_a_position_bias_is_refused_by_name():
    bamba = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("bamba")))
    with pytest.raises(ConfigError, match=r"model.layers.0.mamba \(BambaMixer\).*pass from rank to rank"):
        check_context_parallel(2, bamba, False, {})
    llama = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("llama")))
    with pytest.raises(ConfigError, match="position bias"):
        check_context_parallel(2, llama, True, {})


@pytest.mark.parametrize("cp, tp, devices, fine", [(2, 1, 2, True), (2, 2, 4, True), (1, "auto", 8, True),
                                                    (1, 2, 8, True), (3, 1, 2, False), (2, 2, 2, False),
                                                    (1, 3, 8, False)])  # fmt: skip
def test_the_mesh_sizes_must_make_the_world_or_are_refused_naming_the_setting(cp, tp, devices, fine):
    """Sizes that make the world build the mesh (data x context x tensor parallel; here over torch's fake process
    group of `devices` ranks held by this process), `auto` data parallel taking what the others leave on any number
    of ranks (Lightning's own `auto` would shard over the nodes only: 1 here); others are refused naming the
    setting."""
    from lightning.fabric.plugins.environments import LightningEnvironment
    from lightning.pytorch import LightningModule
    from lightning.pytorch.accelerators import CPUAccelerator
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lit_packing.strategies import MESH_DIMS

    strategy = ShardedStrategy(context_parallel_size=cp, tensor_parallel_size=tp)
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy.num_nodes = 1
    if fine:
        strategy.accelerator, strategy.cluster_environment = CPUAccelerator(), LightningEnvironment()
        strategy.connect(LightningModule())
        torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=devices)
        try:
            strategy.setup_environment()
            mesh, tp = strategy.device_mesh, 1 if tp == "auto" else tp
            if cp > 1:
                assert mesh.mesh_dim_names == MESH_DIMS and tuple(mesh.shape) == (devices // (cp * tp), cp, tp)
            else:
                assert dict(zip(mesh.mesh_dim_names, mesh.shape)) == {"data_parallel": devices // tp,
                                                                      "tensor_parallel": tp}  # fmt: skip
        finally:
            torch.distributed.destroy_process_group()
        return
    setting = CP_SIZE_SETTING if cp > 1 else "trainer.strategy.init_args.tensor_parallel_size"  # data: auto
    with pytest.raises(ConfigError, match=f"{setting}: .*context_parallel_size={cp} .* is not the {devices} ranks"):
        strategy.setup_environment()
    with pytest.raises(ConfigError, match="not a number of ranks"):
        ShardedStrategy(context_parallel_size=0)


def test_the_memory_estimate_counts_a_ranks_share_of_the_pack_and_the_keys_it_gathers():
    from dataclasses import replace

    from lit_packing.batch import StepShape
    from tests.models.test_sharding import memory

    step = StepShape(slot_tokens=16384, attn_pairs=16384 * 512, rows=1, width=16384)
    one = memory(2, 0)
    halves = replace(one, context=2, key_value_bytes=64)
    share = StepShape(slot_tokens=8193, attn_pairs=16384 * 256, rows=1, width=8193)
    # (1000 bytes a token) x 1.5 (a layer's gradients in flight, 2 layers) for 8,193 tokens, plus each layer's keys
    assert halves.estimate(step).activations == one.estimate(share).activations + 2 * 16384 * 64
    assert "1/2 of the pack" in halves.estimate(step).summary()


def test_the_keys_gradients_are_summed_in_fp32_once_cast():
    """A document's first keys are picked by every later piece of it (`key_index`): under bf16-mixed their
    gradients are many bf16 terms. `gather_tokens`' backward sums them in fp32 and casts once (what a bf16 sum, as
    index_select's own backward does, rounds at every addition); on one rank here, over the group on several (the
    CPU ranks' tests below). Keys and values share one gather when their head dims match."""
    from lit_packing.models.context import ContextGroup, gather_tokens

    gen = torch.Generator().manual_seed(0)
    key = torch.randn(8, 2, 4, generator=gen).bfloat16().requires_grad_()
    value = torch.randn(8, 2, 4, generator=gen).bfloat16().requires_grad_()
    index = torch.cat([torch.zeros(300, dtype=torch.long), torch.arange(8)])  # key 0 picked 301 times
    k, v = gather_tokens(key, value, ContextGroup(None, 1, 0), index)
    assert torch.equal(k, key.detach()[index]) and torch.equal(v, value.detach()[index])
    grad_k, grad_v = (torch.randn(len(index), 2, 4, generator=gen).bfloat16() for _ in range(2))
    torch.autograd.backward([k, v], [grad_k, grad_v])
    for leaf, grad in ((key, grad_k), (value, grad_v)):
        exact = torch.zeros(8, 2, 4).index_add_(0, index, grad.float()).bfloat16()
        assert torch.equal(leaf.grad, exact)
        rounded = torch.zeros(2, 4, dtype=torch.bfloat16)
        for term in grad[index == 0]:  # a bf16 sum (GPU atomics, a bf16 reduce-scatter) rounds at each addition
            rounded = rounded + term
        assert not torch.equal(rounded, exact[0])  # and differs: the test can tell


# ----------------------------------------------------------------------------------------------------------------
# CPU ranks


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[float]]:
    """Every case of `context_ranks.py` on 4 ranks in one launch: {case/size: [logits, loss sum, gradient max abs
    difference to one process, another document moved, the changed document still, label count difference]}."""
    from tests.models.test_sharding import env

    out = tmp_path_factory.mktemp("context") / "ranks.json"
    done = launch.run([sys.executable, str(RANKS), json.dumps({"out": str(out)})], cwd=ROOT, env=env(), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_every_backend_on_1_2_and_4_ranks_gives_one_process_logits_loss_and_gradients(ranks):
    """fp64, a pack with one-token documents, documents shorter than 2 x cp, one spanning every rank and tail
    padding; per_example and sdpa_mask; GQA with 1, 2 and 8 key/value heads, a sliding window (Mistral), softcaps
    (Gemma 2). The logits come back bit for bit; the loss sum within 1e-13 (of ~1e3); the gradients within 1e-13,
    except Gemma 2's norm weights (its RMSNorm computes in fp32 even in an fp64 model: their gradient sums differ
    at fp32's rounding, 1e-7, when the tokens are summed in another order)."""
    cases = {case: values for case, values in ranks.items() if "/" in case and not case.startswith("saved/")}
    assert len(cases) == 8 * 3
    for case, (logits, loss, grads, moved, still, labels) in cases.items():
        assert logits < 1e-12 and loss < 1e-10 and labels == 0, case
        assert grads < (1e-6 if case.startswith("gemma2") else 1e-10), case
        assert moved == 0 and still == 0, case  # no other document moved; the changed one did (the probe bites)


@pytest.mark.slow
def test_a_ranks_activations_fall_with_the_context_parallel_ranks(ranks):
    """The point of splitting a pack: a rank's saved activations on a 4,096-token pack fall about as 1 / cp (plus
    the keys and values a rank's kernels keep, about the whole pack's)."""
    one, two, four = (ranks[f"saved/{size}"] for size in (1, 2, 4))
    assert two / one < 0.62 and four / one < 0.36, (two / one, four / one)


@pytest.mark.slow
def test_the_ranks_of_a_context_group_holding_different_packs_all_stop_in_one_line(ranks):
    """Rows of other lengths would hang NCCL's all-gather in the first attention layer; one length with other
    tokens would train silently wrong. Both are refused when the pack is dealt, on every rank of the group."""
    refused = ranks["refused"]
    assert all(f"{CP_SIZE_SETTING}: context-parallel ranks 0 and 1 of a group hold different packs" in message
               for message in refused), refused  # fmt: skip
    assert all("rows of 144 and 80 tokens" in message for message in refused[:2]), refused
    assert all("rows of one length with other tokens" in message for message in refused[2:]), refused
    assert all("\n" not in message for message in refused)
