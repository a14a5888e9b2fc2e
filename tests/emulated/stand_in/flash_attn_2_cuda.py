"""Stand-in for flash-attn's compiled `flash_attn_2_cuda` extension: `varlen_fwd` / `varlen_bwd` with the real
positional signatures (flash-attn 2.8, csrc/flash_attn/flash_api.cpp), computed by the exact reference kernels.

Importable only on a simulated GPU machine (`tests.emulated.machine`), which puts this folder on `sys.path`; the
flash-attn Python package above it is the real one, from its PyPI sdist, never built.
"""

from __future__ import annotations

import torch

from tests.emulated import kernels
from tests.emulated.machine import current_machine


def varlen_fwd(
    q, k, v, out_, cu_seqlens_q, cu_seqlens_k, seqused_k, leftpad_k, block_table, alibi_slopes,
    max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
    window_size_left, window_size_right, softcap, return_softmax, gen,
):  # fmt: skip
    machine = current_machine("flash_attn_2_cuda.varlen_fwd", q, k, v)
    kernels.check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, capability=machine.capability)
    if seqused_k is not None or leftpad_k is not None or block_table is not None or alibi_slopes is not None:
        raise NotImplementedError("the emulated varlen_fwd covers training: no seqused_k, leftpad_k, paged KV, alibi")
    if softcap > 0:
        kernels._check(p_dropout == 0, "Softcapping does not support dropout for now")
    if max_seqlen_q == 1:
        is_causal = False  # causal=true is the same as causal=false for one query
    seed = machine.next_seed() if p_dropout > 0 else 0
    out, lse = kernels.varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, scale=softmax_scale, causal=is_causal,
        left=window_size_left, right=window_size_right, softcap=softcap, dropout_p=p_dropout, seed=seed,
        max_q=max_seqlen_q, max_k=max_seqlen_k,
    )  # fmt: skip
    if out_ is not None:
        out_.copy_(out)
        out = out_
    rng_state = torch.tensor([seed, 0], dtype=torch.int64)
    return [out, lse, torch.empty(0, dtype=q.dtype), rng_state]


def varlen_bwd(
    dout, q, k, v, out, softmax_lse, dq_, dk_, dv_, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
    max_seqlen_q, max_seqlen_k, p_dropout, softmax_scale, zero_tensors, is_causal,
    window_size_left, window_size_right, softcap, deterministic, gen, rng_state,
):  # fmt: skip
    machine = current_machine("flash_attn_2_cuda.varlen_bwd", q, k, v)
    kernels.check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, capability=machine.capability, backward=True)
    kernels._check(out.dtype == q.dtype, "query and out must have the same dtype")
    kernels._check(dout.dtype == q.dtype, "query and dout must have the same dtype")
    if max_seqlen_q == 1:
        is_causal = False
    seed = int(rng_state[0]) if rng_state is not None else 0
    grads = kernels.varlen_backward(
        dout, q, k, v, cu_seqlens_q, cu_seqlens_k, scale=softmax_scale, causal=is_causal,
        left=window_size_left, right=window_size_right, softcap=softcap, dropout_p=p_dropout, seed=seed,
        max_q=max_seqlen_q, max_k=max_seqlen_k,
    )  # fmt: skip
    results = []
    for given, grad in zip((dq_, dk_, dv_), grads):
        if given is not None:
            given.copy_(grad)
            grad = given
        results.append(grad)
    softmax_d = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
    return [*results, softmax_d]


def fwd(*args, **kwargs):
    raise NotImplementedError("the emulated flash_attn_2_cuda has the varlen kernels only (the packed path)")


bwd = fwd
