"""Exact CPU reference kernels for FlashAttention-2's varlen forward and backward, with the real kernels' checks.

    out, lse = varlen_forward(q, k, v, cu_q, cu_k, scale=D**-0.5, causal=True)     # q (Tq, H, D), k/v (Tk, Hkv, D)
    dq, dk, dv = varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, scale=D**-0.5, causal=True)

What a GPU kernel does, on the host: fp32 accumulation of fp16 / bf16 inputs, the output in the input dtype, the
logsumexp (H, Tq) in fp32, bottom-right-aligned causal and sliding-window masks (key j of query i is attended when
`i + (Lk - Lq) - left <= j <= i + (Lk - Lq) + right`, -1 = unbounded), softcap `tanh(s / c) * c`, GQA, dropout
replayed in the backward from the seed in `rng_state`. The input checks are the kernels' own, with their messages.
What a kernel leaves undefined is made visible: rows of q no `cu_seqlens` segment covers are never written by the
real kernel (`torch.empty`), so they come back NaN here, in the output and in the gradients.

Both the aten ops PyTorch's `varlen_attn` calls (`_flash_attention_forward` / `_backward`) and the stand-in
`flash_attn_2_cuda` module that flash-attn's own Python interface calls are thin adapters over these two functions.
"""

from __future__ import annotations

import torch


class KernelError(RuntimeError):
    """What a CUDA kernel's TORCH_CHECK raises (a RuntimeError with the check's message)."""


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise KernelError(message)


def check_inputs(q, k, v, cu_q, cu_k, *, capability: tuple[int, int], backward: bool = False) -> None:
    """The checks FlashAttention-2's varlen entry points make before launching, in their order and words."""
    _check(capability[0] >= 8, "FlashAttention only supports Ampere GPUs or newer.")
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    _check(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
    _check(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
    for x in (q, k, v):
        _check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    _check(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
    _check(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "varlen q, k, v must be (total, heads, head_dim)")
    batch, head_size = cu_q.numel() - 1, q.shape[-1]
    _check(batch > 0, "batch size must be positive")
    if backward:
        _check(head_size % 8 == 0, "head_size should be a multiple of 8")
        _check(head_size <= 256, "FlashAttention backward only supports head dimension at most 256")
    else:
        _check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
        _check(head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    _check(q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query")
    _check(cu_k.numel() == cu_q.numel(), "cu_seqlens_k must have shape (batch_size + 1)")


def _allowed(lq: int, lk: int, causal: bool, left: int, right: int) -> torch.Tensor:
    """(Lq, Lk) bool: which keys each query attends, FlashAttention's bottom-right-aligned convention."""
    if causal:
        right = 0
    i = torch.arange(lq)[:, None] + (lk - lq)
    j = torch.arange(lk)[None, :]
    mask = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        mask &= j <= i + right
    if left >= 0:
        mask &= j >= i - left
    return mask


def _probs(q, k, mask, scale, softcap):
    """fp32 scores -> probabilities of one sequence: q (Lq, H, D), k (Lk, H, D) -> P, lse (H, Lq), capped scores."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (H, Lq); -inf where a row attends nothing
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # such a row outputs 0, as the kernel does
    return probs, lse, scores


def _expand(x, heads):
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _fold(x, kv_heads):
    """Sum a (L, H, D) gradient over the query heads that share each of `kv_heads` key/value heads (GQA)."""
    length, heads, dim = x.shape
    return x.view(length, kv_heads, heads // kv_heads, dim).sum(2)


def _keep_masks(seed: int, p: float, heads: int, spans):
    """The dropout keep-masks (scaled), one per sequence, replayable from the seed."""
    if p <= 0:
        return [None] * len(spans)
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(heads, lq, lk, generator=gen) >= p).float() / (1 - p) for lq, lk in spans]


def _spans(cu_q, cu_k):
    bq, bk = cu_q.tolist(), cu_k.tolist()
    return list(zip(bq[:-1], bq[1:], bk[:-1], bk[1:]))


def _run(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap, dropout_p, seed, dout=None, max_q=None, max_k=None):
    """fp32 forward over every sequence (out (Tq, H, D) with NaN rows, lse (H, Tq)); with `dout`, the analytic
    backward instead (dq, dk, dv in fp32, NaN rows where no segment covers them). A kernel covers `max_q` queries
    and `max_k` keys of a sequence: a longer one's rows past them are left unwritten, NaN here."""
    heads = q.shape[1]
    bounds = _spans(cu_q, cu_k)
    keeps = _keep_masks(seed, dropout_p, heads, [(b - a, d - c) for a, b, c, d in bounds])
    qf, kf, vf = (x.float() for x in (q, k, v))
    if dout is None:
        out = torch.full(q.shape, float("nan"))
        lse = torch.full((heads, q.shape[0]), float("nan"))
    else:
        grads = [torch.full(x.shape, float("nan")) for x in (q, k, v)]
        do = dout.float()
    for (a, b, c, d), keep in zip(bounds, keeps):
        if b <= a:
            continue
        mask = _allowed(b - a, d - c, causal, left, right)
        qs, ks, vs = qf[a:b], _expand(kf[c:d], heads), _expand(vf[c:d], heads)
        probs, seg_lse, scores = _probs(qs, ks, mask, scale, softcap)
        dropped = probs if keep is None else probs * keep
        if dout is None:
            out[a:b] = torch.einsum("hqk,khd->qhd", dropped, vs)
            lse[:, a:b] = seg_lse
            continue
        dos = do[a:b]
        dv = torch.einsum("hqk,qhd->khd", dropped, dos)
        dp = torch.einsum("qhd,khd->hqk", dos, vs)
        if keep is not None:
            dp = dp * keep
        ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))  # softmax backward
        if softcap:
            ds = ds * (1 - (scores.masked_fill(~mask, 0.0) / softcap) ** 2)  # d tanh
        ds = ds * scale
        grads[0][a:b] = torch.einsum("hqk,khd->qhd", ds, ks)
        grads[1][c:d] = _fold(torch.einsum("hqk,qhd->khd", ds, qs), k.shape[1])
        grads[2][c:d] = _fold(dv, v.shape[1])
    for a, b, c, d in bounds:  # what a kernel told a smaller max_seqlen never computes
        if max_q is not None and b - a > max_q or max_k is not None and d - c > max_k:
            start = a + (max_q if max_q is not None and b - a > max_q else 0)
            for x in [out, lse.T] if dout is None else grads[:1]:
                x[start:b] = float("nan")
    return (out, lse) if dout is None else grads


def varlen_forward(q, k, v, cu_q, cu_k, *, scale, causal, left=-1, right=-1, softcap=0.0, dropout_p=0.0, seed=0,
                   max_q=None, max_k=None):  # fmt: skip
    """Output in q's dtype (NaN rows where no segment covers q) and the fp32 logsumexp (H, Tq)."""
    out, lse = _run(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap, dropout_p, seed, None, max_q, max_k)
    return out.to(q.dtype), lse


def varlen_backward(dout, q, k, v, cu_q, cu_k, *, scale, causal, left=-1, right=-1, softcap=0.0, dropout_p=0.0, seed=0,
                    max_q=None, max_k=None):  # fmt: skip
    """dq, dk, dv in q's dtype, from the recomputed fp32 forward; rows no segment covers come back NaN."""
    grads = _run(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap, dropout_p, seed, dout, max_q, max_k)
    return tuple(g.to(q.dtype) for g in grads)
