"""Context parallelism on the GPU kernels (simulated GPU, flash_attn and torch_varlen in bf16): each rank's dealt
pieces, attending the keys gathered from every rank through `key_index` with their own `cu_seqlens_k` and
causality aligned bottom-right, give the whole pack's attention output and its gradients, put back in the pack's
order. The ranks are played in one process: what a rank's all-gather would hand it is built from every rank's row,
as the all-gather lays them out (rank-major); the collectives themselves run on CPU ranks (tests/models)."""

from __future__ import annotations

import pytest
import torch

from lit_packing.batch import CU_SEQ_LENS_K, CU_SEQ_LENS_Q, GATHERED_INDEX, MAX_LENGTH_K, MAX_LENGTH_Q
from lit_packing.data.collate import PackedCollator
from lit_packing.models.context import deal, deal_of, plan
from lit_packing.models.kernels import flash_attn_varlen, torch_varlen
from tests.emulated.machine import SimulatedGPU
from tests.emulated.test_backends import KERNEL_OPS
from tests.helpers import make_examples

KERNELS = {"flash_attn": flash_attn_varlen, "torch_varlen": torch_varlen}
LENGTHS = [1, 3, 37, 2, 1, 64, 5, 20, 7]


def padded_rows(x: torch.Tensor, tokens: list, slots: int) -> list[torch.Tensor]:
    """Each rank's row of `x` (T, ...): its tokens, then zeros up to `slots`."""
    return [torch.cat([x[torch.from_numpy(t).to(x.device)], x.new_zeros(slots - len(t), *x.shape[1:])])
            for t in tokens]  # fmt: skip


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_dealt_pieces_on_the_gpu_kernels_give_the_whole_packs_attention(backend, window):
    with SimulatedGPU(flash_attn=backend == "flash_attn") as machine:
        batch = PackedCollator(pad_to_multiple_of=16)(make_examples(LENGTHS, seed=2))
        cu = batch[CU_SEQ_LENS_Q]
        total, gen = int(cu[-1]), torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(total, h, 16, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
                   for h in (8, 2, 2))  # fmt: skip
        opts = {"causal": True, "scale": 0.25, "window": window, "softcap": None, "dropout": 0.0}
        kernel, lengths = KERNELS[backend], torch.diff(cu)
        whole = kernel(q, k, v, cu.cuda(), cu.cuda(), int(lengths.max()), int(lengths.max()), **opts)
        dout = torch.randn(whole.shape, generator=gen).to("cuda", torch.bfloat16)
        expected = torch.autograd.grad(whole, (q, k, v), dout)
        calls = machine.kernel_calls.get(KERNEL_OPS[backend], 0)
        for size in (2, 4):
            dealt = deal_of(plan(cu.numpy(), size))
            keys, values = (torch.cat(padded_rows(x, dealt.tokens, dealt.slots)) for x in (k, v))  # the all-gather
            outs = []
            for rank, rows in enumerate(padded_rows(q, dealt.tokens, dealt.slots)):
                local = deal(batch, size, rank)
                index = local[GATHERED_INDEX].cuda()
                outs.append(kernel(rows, keys.index_select(0, index), values.index_select(0, index),
                                   local[CU_SEQ_LENS_Q].cuda(), local[CU_SEQ_LENS_K].cuda(), local[MAX_LENGTH_Q],
                                   local[MAX_LENGTH_K], **opts))  # fmt: skip
            got = dealt.undeal(outs)
            torch.testing.assert_close(got.float(), whole.float(), atol=0, rtol=0)  # the same keys, one by one
            grads = torch.autograd.grad(got, (q, k, v), dout)
            for name, grad, want in zip("qkv", grads, expected):
                torch.testing.assert_close(grad.float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"d{name}")
        assert machine.kernel_calls[KERNEL_OPS[backend]] - calls >= 2 + 4  # every rank's pieces ran the kernel
