"""Context parallelism measured: how evenly the deal spreads CHAMP packs over the ranks, and what a rank holds and
how long a step takes when one 16k-token pack is split over 1, 2 and 4 CPU ranks.

    python -m benchmarks.context_parallel                   # both parts (a few minutes on CPU)
    python -m benchmarks.context_parallel --part balance    # the spread alone (seconds)
    python -m benchmarks.context_parallel --part memory --device cuda --layers 30 --tokens 65536   # GPUs, NCCL

balance: CHAMP chats (SmolLM2's tokenizer, cut at 4,096 tokens) packed best-fit into packs of at most 16,384 tokens;
for each pack and cp in 2, 4, 8, the most loaded rank's tokens and causal (query, key) pairs over the mean: dealt
by `context.plan` (documents cut into 2 x cp chunks, head and tail to one rank), and cut into cp contiguous blocks
(a plain sequence split, as a causal mask over the whole row would take).

memory: SmolLM2-135M's architecture with 6 of its 30 layers (random weights, fp32, `per_example` attention), one
training step on the first CHAMP pack of 16,384 tokens, on 1, 2 and 4 ranks over gloo, each in its own launch: per
rank, the bytes autograd saves in the forward (the activations), the peak growth of resident memory during the
step, and the step's seconds (2 CPU cores shared by the ranks: the ratio of memory is the point, not the speed).
With `--device cuda`: 1, 2, 4, ... ranks up to the GPUs there are, one GPU each over NCCL, bf16-mixed, `torch_varlen`,
the CHAMP pack repeated up to `--tokens`: peak allocated memory per rank and real tokens per second. Every launch
of more than one rank is compared with the one-rank launch on the same pack and weights: the loss (summed over the
ranks, relative to one rank's) and every parameter's gradient (summed over the ranks, the largest difference
relative to the largest gradient).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

PACK_TOKENS = 16384
SIZES = (1, 2, 4)
LAYERS = 6


def champ_packs(max_length: int = 4096, max_tokens: int = PACK_TOKENS) -> tuple[list[list[int]], list]:
    """CHAMP's tokenized examples packed best-fit: the packs' example lengths, and the examples (token ids and
    labels) of the first pack."""
    from transformers import AutoTokenizer

    from lit_packing.assets import resolve_pretrained
    from lit_packing.data import ChampChats
    from lit_packing.data.tokenize import tokenize_dataset
    from lit_packing.samplers.best_fit import best_fit_packs

    tokenizer = AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    tokenized, _ = tokenize_dataset(ChampChats().load(None), tokenizer, max_length=max_length)
    lengths = np.array([len(ids) for ids in tokenized["input_ids"]])
    items, offsets = best_fit_packs(lengths, max_tokens, None)
    packs = [items[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    first = [{"input_ids": tokenized[int(i)]["input_ids"], "labels": tokenized[int(i)]["labels"]} for i in packs[0]]
    return [[int(lengths[i]) for i in pack] for pack in packs], first


def contiguous_spread(cu: np.ndarray, size: int) -> tuple[float, float]:
    """The pack cut into `size` equal blocks of the row: (tokens, pairs) of the most loaded over the mean."""
    total = int(cu[-1])
    edges = [total * r // size for r in range(size + 1)]
    position = np.concatenate([np.arange(b - a) for a, b in zip(cu[:-1], cu[1:])]) + 1  # keys each query sees
    pairs = np.array([position[a:b].sum() for a, b in zip(edges[:-1], edges[1:])], dtype=float)
    tokens = np.diff(edges).astype(float)
    return float(tokens.max() / tokens.mean()), float(pairs.max() / pairs.mean())


def balance() -> None:
    from lit_packing.models.context import spread

    packs, _ = champ_packs()
    print(f"{len(packs)} CHAMP packs of at most {PACK_TOKENS:,} tokens, {np.mean([len(p) for p in packs]):.1f} "
          "documents each")  # fmt: skip
    print(
        "| cp | dealt: tokens max/mean (mean, worst) | dealt: pairs max/mean | contiguous: tokens | contiguous: pairs |"
    )
    print("|---|---|---|---|---|")
    for size in (2, 4, 8):
        dealt = np.array([spread(np.cumsum([0, *p]), size) for p in packs])
        blocks = np.array([contiguous_spread(np.cumsum([0, *p]), size) for p in packs])
        print(f"| {size} | {dealt[:, 0].mean():.4f}, {dealt[:, 0].max():.4f} | {dealt[:, 1].mean():.4f}, "
              f"{dealt[:, 1].max():.4f} | {blocks[:, 0].mean():.4f} | {blocks[:, 1].mean():.3f}, "
              f"{blocks[:, 1].max():.3f} |")  # fmt: skip


def memory(device: str, layers: int, tokens: int) -> None:
    import torch
    import torch.multiprocessing as mp

    _, first = champ_packs()
    while sum(len(x["input_ids"]) for x in first) * 2 <= tokens:  # a longer pack of the same documents
        first = first + first
    sizes = SIZES
    if device == "cuda":
        sizes = tuple(2**i for i in range(8) if 2**i <= torch.cuda.device_count())
    rows = []
    with tempfile.TemporaryDirectory() as kept:
        reference = os.path.join(kept, "one_rank.pt")  # the one-rank loss and gradients, which the others must give
        for size in sizes:
            with tempfile.TemporaryDirectory() as folder:
                out = os.path.join(folder, "out.json")
                mp.spawn(step_on_rank, args=(size, folder, first, out, device, layers, reference), nprocs=size,
                         join=True)  # fmt: skip
                with open(out) as file:
                    rows.append(json.load(file))
    one = rows[0]
    precision = "bf16-mixed, torch_varlen" if device == "cuda" else "fp32, per_example"
    print(f"one training step on a pack of {rows[0]['tokens']:,} CHAMP tokens ({rows[0]['documents']} documents), "
          f"SmolLM2-135M's architecture with {layers} layers, {precision}, per rank:")  # fmt: skip
    print(
        "| cp ranks | tokens per rank | saved activations (MiB) | x 1 rank | peak memory growth (MiB) | x 1 rank | "
        "step (s) | loss vs 1 rank | gradients vs 1 rank |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['size']} | {row['slots']:,} | {row['saved'] / 2**20:,.0f} | {row['saved'] / one['saved']:.2f} | "
              f"{row['rss'] / 2**20:,.0f} | {row['rss'] / one['rss']:.2f} | {row['seconds']:.1f} "
              f"({row['tokens'] / row['seconds']:,.0f} tokens/s) | {row['loss_error']:.1e} | "
              f"{row['grad_error']:.1e} |")  # fmt: skip
    worst = max(max(row["loss_error"], row["grad_error"]) for row in rows)
    bound = 2e-2 if device == "cuda" else 1e-4  # bf16-mixed sums in another order; fp32 on CPU
    print(f"largest relative difference from one rank: {worst:.1e} (bound {bound:.0e})")
    if worst > bound:
        raise SystemExit(f"context parallelism does not give one rank's loss and gradients: {worst:.1e} > {bound:.0e}")


def step_on_rank(rank: int, size: int, folder: str, examples: list, out: str, device: str, layers: int,
                 reference: str) -> None:  # fmt: skip
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.common import peak_memory, reset_peak_memory, synchronize
    from lit_packing.assets import resolve_pretrained
    from lit_packing.batch import model_inputs
    from lit_packing.data.collate import PackedCollator
    from lit_packing.models.context import ContextGroup, deal
    from lit_packing.models.head import head_inputs
    from lit_packing.models.loss import causal_lm_loss
    from lit_packing.models.pack import pack_model

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, 2 // size))
    where = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{folder}/store", rank=rank,
                            world_size=size)  # fmt: skip
    config = AutoConfig.from_pretrained(resolve_pretrained("smollm2", with_model=False))
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(where)
    pack_model(model, "torch_varlen" if cuda else "per_example", where)
    batch = {k: v.to(where) if torch.is_tensor(v) else v for k, v in PackedCollator()(examples).items()}
    local = deal(batch, ContextGroup(dist.group.WORLD, size, rank)) if size > 1 else batch
    saved: dict[int, int] = {}

    def keep(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    dist.barrier()
    reset_peak_memory(where)
    before, start = peak_memory(where), time.perf_counter()
    autocast = torch.autocast(where.type, dtype=torch.bfloat16, enabled=cuda)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor), autocast:
        inputs = head_inputs(model, model_inputs(local))
        loss = causal_lm_loss(inputs, local, "token").objective
    loss.backward()
    synchronize(where)
    growth = (peak_memory(where) - before) * 2**30
    dist.barrier()
    seconds = time.perf_counter() - start
    # Collectives take device tensors: NCCL has no host path.
    worst = torch.tensor([float(sum(saved.values())), growth], dtype=torch.float64, device=where)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    summed = torch.cat([loss.detach().float().reshape(1), *(p.grad.float().flatten() for p in model.parameters())])
    dist.all_reduce(summed)  # each rank's share of the loss sum and of every gradient: one rank's whole
    if rank == 0:
        loss_error = grad_error = 0.0
        if size == 1:
            torch.save(summed.cpu(), reference)
        else:
            one = torch.load(reference, weights_only=True).to(where)
            loss_error = float((summed[0] - one[0]).abs() / one[0].abs())
            grad_error = float((summed[1:] - one[1:]).abs().max() / one[1:].abs().max())
        with open(out, "w") as file:
            json.dump({"size": size, "slots": int(local["input_ids"].shape[1]), "saved": worst[0].item(),
                       "rss": worst[1].item(), "seconds": seconds, "tokens": int(batch["input_ids"].shape[1]),
                       "documents": len(examples), "loss_error": loss_error, "grad_error": grad_error},
                      file)  # fmt: skip
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("balance", "memory", "both"), default="both")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=LAYERS, help="decoder layers of SmolLM2's architecture")
    parser.add_argument("--tokens", type=int, default=PACK_TOKENS, help="the pack: CHAMP's first, repeated to this")
    args = parser.parse_args(argv)
    if args.part in ("balance", "both"):
        balance()
    if args.part in ("memory", "both"):
        memory(args.device, args.layers, args.tokens)


if __name__ == "__main__":
    main(sys.argv[1:])
