"""Context parallelism on CPU ranks over gloo, in fp64, against one process on the same pack, as a script.

    python tests/helpers/context_ranks.py '{"out": "/tmp/cp.json"}'

4 ranks run every case once per group size: 4 (one group), 2 (ranks 0-1 and 2-3), 1 (each rank alone). A case is
a model config and a backend; each rank builds the same seeded model, runs the whole pack in one process (the
reference: logits, the loss sum, every parameter's gradient), then its dealt share under its group (`deal`: the
loss sum and gradients summed over the group, the logits gathered back into the pack's order). The leakage probe
changes one token of one document and runs the dealt pack again: every other document's logits must be bit for
bit what they were. Rank 0 writes, per case and size, the largest differences over every rank, and per size the
most activation bytes a rank saves on a pack of 4,096 tokens, and what each rank raised when the ranks of its
group were handed different packs.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoConfig, AutoModelForCausalLM

from lit_packing.batch import CU_SEQ_LENS_Q, INPUT_IDS, LABELS, model_inputs
from lit_packing.data.collate import PackedCollator
from lit_packing.errors import ConfigError
from lit_packing.models.context import ContextGroup, deal, deal_of, plan
from lit_packing.models.loss import causal_lm_loss
from lit_packing.models.pack import pack_model
from tests.helpers import make_examples

WORLD = 4
# One-token documents, documents shorter than 2 x 4, one longer than the others together, tail padding.
LENGTHS = [1, 3, 37, 2, 1, 64, 5, 20, 7]
LLAMA = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 8, "max_position_embeddings": 256}  # fmt: skip
CASES = {
    **{f"llama_kv{kv}_{backend}": ({**LLAMA, "num_key_value_heads": kv}, backend)
       for kv in (1, 2, 8) for backend in ("per_example", "sdpa_mask")},
    "mistral_window_per_example": ({**LLAMA, "model_type": "mistral", "num_key_value_heads": 2, "sliding_window": 6},
                                   "per_example"),
    "gemma2_softcap_sdpa_mask": ({**LLAMA, "model_type": "gemma2", "num_key_value_heads": 2, "head_dim": 8,
                                  "attn_logit_softcapping": 20.0, "sliding_window": 16}, "sdpa_mask"),
}  # fmt: skip


def pack() -> dict:
    return PackedCollator(pad_to_multiple_of=16)(make_examples(LENGTHS, vocab=300, seed=3))


def forward(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(**model_inputs(batch), use_cache=False).logits
    return logits[0], causal_lm_loss(logits, batch, "token").objective


def run_case(config: dict, backend: str, groups: dict[int, ContextGroup]) -> dict[int, list[float]]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), attn_implementation="eager")
    pack_model(model, backend)
    model.double()
    batch = pack()
    logits, objective = forward(model, batch)
    objective.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = {}
    cu = batch[CU_SEQ_LENS_Q].numpy()
    for size, group in groups.items():
        model.zero_grad()
        local = deal(batch, group)
        mine, part = forward(model, local)
        part.backward()
        total = part.detach().clone()
        dist.all_reduce(total, group=group.group)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        for grad in grads.values():
            dist.all_reduce(grad, group=group.group)
        whole = gathered(mine.detach(), group, cu)
        # The leakage probe: one token of the longest document changed, every other token's logits the same bits.
        changed = {**batch, INPUT_IDS: batch[INPUT_IDS].clone()}
        start = int(cu[5])
        changed[INPUT_IDS][0, start + 10] = (changed[INPUT_IDS][0, start + 10] + 1) % config["vocab_size"]
        with torch.no_grad():
            again = gathered(forward(model, deal(changed, group))[0], group, cu)
        others = torch.ones(len(whole), dtype=torch.bool)
        others[start : int(cu[6])] = False
        labels = int((batch[LABELS][0, 1:] != -100).sum())
        local_labels = torch.tensor(float((local[LABELS][0, 1:] != -100).sum()), dtype=torch.float64)
        dist.all_reduce(local_labels, group=group.group)
        out[size] = [
            float((whole - logits.detach()).abs().max()),
            float((total - objective.detach()).abs()),
            max(float((grads[n] - expected[n]).abs().max()) for n in expected),
            float(not torch.equal(again[others], whole[others])),  # 1.0: another document's logits moved
            float(torch.equal(again[~others], whole[~others])),  # 1.0: the changed document's did not (no probe)
            abs(float(local_labels) - labels),
        ]
    return out


def saved_bytes(group: ContextGroup) -> int:
    """What autograd keeps for the backward of one forward of a 4-layer Llama on this rank's share of a pack of
    4,096 tokens in 5 documents (per_example, fp32)."""
    torch.manual_seed(0)
    config = {**LLAMA, "num_key_value_heads": 2, "num_hidden_layers": 4, "max_position_embeddings": 4096}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    pack_model(model, "per_example")
    local = deal(PackedCollator()(make_examples([1500, 900, 800, 600, 296], vocab=300, seed=4)), group)
    storages: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        forward(model, local)
    return sum(storages.values())


def gathered(local: torch.Tensor, group: ContextGroup, cu) -> torch.Tensor:
    if group.size == 1:
        return deal_of(plan(cu, 1)).undeal([local])
    rows = [torch.empty_like(local) for _ in range(group.size)]
    dist.all_gather(rows, local.contiguous(), group=group.group)
    return deal_of(plan(cu, group.size)).undeal(rows)


def worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    alone = [dist.new_group([r]) for r in range(WORLD)]
    groups = {
        4: ContextGroup(dist.group.WORLD, 4, rank),
        2: ContextGroup(pairs[rank // 2], 2, rank % 2),
        1: ContextGroup(alone[rank], 1, 0),
    }
    results = {}
    for name, (config, backend) in CASES.items():
        found = run_case(config, backend, groups)
        for size, values in found.items():
            worst = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            results[f"{name}/{size}"] = worst.tolist()
    for size, group in groups.items():  # activations per rank: the bytes autograd saves in one dealt forward
        worst = torch.tensor(float(saved_bytes(group)), dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[f"saved/{size}"] = worst.item()
    results["refused"] = refusals(rank, groups[2])
    if rank == 0:
        with open(out, "w") as file:
            json.dump(results, file)
    dist.destroy_process_group()


def refusals(rank: int, group: ContextGroup) -> list[str]:
    """Groups of 2 whose ranks hold different packs: ranks 0-1 rows of other lengths (which would hang NCCL's
    gathers), ranks 2-3 one length with one token changed. What each of the 4 ranks raised when dealing."""
    batch = pack()
    if rank == 1:  # the pack without its 64-token document: a shorter row
        batch = PackedCollator(pad_to_multiple_of=16)(make_examples(LENGTHS[:5] + LENGTHS[6:], vocab=300, seed=3))
    elif rank == 3:
        batch = {**batch, INPUT_IDS: batch[INPUT_IDS].clone()}
        batch[INPUT_IDS][0, 40] = (batch[INPUT_IDS][0, 40] + 1) % 300
    try:
        deal(batch, group)
        message = ""
    except ConfigError as error:
        message = str(error)
    messages: list[str] = [""] * WORLD
    dist.all_gather_object(messages, message)
    return messages


def main(settings: dict) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(worker, args=(os.path.join(folder, "store"), settings["out"]), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
