"""The emulated tier's own ground: the reference kernels equal plain attention (fp64), refuse what the CUDA kernels
refuse with their messages, show undefined rows as NaN, and run only once something is on the simulated device."""

from __future__ import annotations

import pytest
import torch

from tests.emulated import kernels
from tests.emulated.machine import SimulatedGPU

LENGTHS = [5, 1, 9, 9, 3]


def inputs(lengths=LENGTHS, heads=4, kv_heads=2, dim=16, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu


def plain(q, k, v, cu, *, scale, window=None, softcap=None):
    """fp64 attention of each sequence alone: transformers' convention (key within (i - window, i])."""
    outs = []
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].double().transpose(0, 1) for x in (q, k, v))
        ks, vs = (x.repeat_interleave(qs.shape[0] // x.shape[0], dim=0) for x in (ks, vs))
        scores = qs @ ks.transpose(-1, -2) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        i = torch.arange(b - a)
        dist = i[:, None] - i[None, :]
        allowed = dist >= 0 if window is None else (dist >= 0) & (dist < window)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append((probs @ vs).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("window, softcap, scale", [(None, None, 0.25), (4, None, 0.25), (None, 5.0, 0.1)])
def test_forward_and_backward_equal_plain_attention(window, softcap, scale):
    q, k, v, cu = inputs(dtype=torch.float32)
    left = -1 if window is None else window - 1
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = plain(*leaves, cu, scale=scale, window=window, softcap=softcap)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, leaves, dout)

    half = [x.bfloat16() for x in (q, k, v)]
    opts = {"scale": scale, "causal": True, "left": left, "softcap": softcap or 0.0}
    out, lse = kernels.varlen_forward(*half, cu, cu, **opts)
    grads = kernels.varlen_backward(dout.bfloat16(), *half, cu, cu, **opts)

    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and lse.shape == (4, sum(LENGTHS))
    # fp32 accumulation of bf16 inputs: within bf16 rounding of the exact (fp64) values
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    for grad, ref_grad, x in zip(grads, ref_grads, half):
        assert grad.shape == x.shape and grad.dtype == torch.bfloat16  # GQA: dk, dv keep the 2 kv heads
        torch.testing.assert_close(grad.double(), ref_grad, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("window", [None, 4])
def test_softcap_and_window_are_exact_where_they_bite(window):
    """fp32 accumulation against fp64 on the same inputs, before the output's rounding: scores of about +-20 under
    a cap of 2 (the cap changes the output by far more than the tolerance), forward and backward."""
    q, k, v, cu = inputs(dtype=torch.float32)
    q = q * 6
    left = -1 if window is None else window - 1
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref = plain(*leaves, cu, scale=0.5, window=window, softcap=2.0)
    dout = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, leaves, dout)
    out, _ = kernels._run(q, k, v, cu, cu, 0.5, True, left, -1, 2.0, 0.0, 0)
    grads = kernels._run(q, k, v, cu, cu, 0.5, True, left, -1, 2.0, 0.0, 0, dout=dout.float())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad.double(), ref_grad, atol=1e-4, rtol=1e-4)
    uncapped = plain(q.double(), k.double(), v.double(), cu, scale=0.5, window=window)
    assert (uncapped - ref).abs().max() > 0.1  # the cap bites


def test_rows_past_max_seqlen_come_back_nan():
    """A kernel told a max_seqlen below a sequence's length never computes that sequence's later rows."""
    q, k, v, cu = inputs()  # lengths 5 1 9 9 3
    out, _ = kernels.varlen_forward(q, k, v, cu, cu, scale=0.25, causal=True, max_q=6, max_k=9)
    bounds = cu.tolist()
    for (a, b), length in zip(zip(bounds[:-1], bounds[1:]), LENGTHS):
        assert out[a : a + min(length, 6)].isfinite().all()
        assert out[a + 6 : b].isnan().all()


def test_dropout_backward_is_the_gradient_of_the_same_dropped_forward():
    """The backward replays the forward's dropout mask from its seed: it is the exact gradient of that forward."""
    q, k, v, cu = inputs(dtype=torch.float32)
    opts = {"scale": 0.25, "causal": True, "dropout_p": 0.3, "seed": 7}
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, _ = kernels._run(*leaves, cu, cu, 0.25, True, -1, -1, 0.0, 0.3, 7)
    dout = torch.randn(out.shape, dtype=torch.float64)
    expected = torch.autograd.grad(out, leaves, dout)
    got = kernels.varlen_backward(dout.float(), q, k, v, cu, cu, **opts)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, atol=1e-5, rtol=1e-5)
    undropped, _ = kernels.varlen_forward(q, k, v, cu, cu, scale=0.25, causal=True)
    assert not torch.allclose(kernels.varlen_forward(q, k, v, cu, cu, **opts)[0], undropped)


def test_rows_no_segment_covers_come_back_nan():
    """A kernel never writes the rows of q past cu_seqlens[-1] (its output is torch.empty): NaN here, so a caller
    that forgets tokens cannot pass by luck."""
    q, k, v, cu = inputs()
    short = cu.clone()
    short[-1] -= 2
    out, _ = kernels.varlen_forward(q, k, v, short, short, scale=0.25, causal=True)
    dq, dk, dv = kernels.varlen_backward(torch.ones_like(q), q, k, v, short, short, scale=0.25, causal=True)
    for x in (out, dq, dk, dv):
        assert x[-2:].isnan().all() and not x[:-2].isnan().any()


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, cu: (q.float(), k.float(), v.float(), cu), "only support fp16 and bf16"),
        (lambda q, k, v, cu: (q, k, v.half(), cu), "query and value must have the same dtype"),
        (lambda q, k, v, cu: (q, k.half(), v, cu), "query and key must have the same dtype"),
        (lambda q, k, v, cu: (q, k, v, cu.long()), "cu_seqlens_q must have dtype int32"),
        (lambda q, k, v, cu: (q, k, v, torch.stack([cu, cu], 1)[:, 0]), "cu_seqlens_q must be contiguous"),
        (lambda q, k, v, cu: (q[..., :12], k[..., :12], v[..., :12], cu), "head_size that is a multiple of 8"),
        (lambda q, k, v, cu: (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu), "contiguous last dim"),
    ],
)
def test_the_kernels_checks_and_messages(change, message):
    q, k, v, cu = change(*inputs())
    with pytest.raises(kernels.KernelError, match=message):
        kernels.check_inputs(q, k, v, cu, cu, capability=(9, 0))


def test_pre_ampere_is_refused():
    q, k, v, cu = inputs()
    with pytest.raises(kernels.KernelError, match="Ampere GPUs or newer"):
        kernels.check_inputs(q, k, v, cu, cu, capability=(7, 5))


def test_a_kernel_runs_only_on_the_device():
    """Host tensors reach a CUDA kernel only by mistake, and fail there as they would on a GPU; once something is
    moved to the device, the same call runs. Outside a machine the CPU kernels refuse as the missing ones did."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v, cu = inputs(heads=2, kv_heads=2)
    call = lambda: varlen_attn(q, k, v, cu, cu, 9, 9, window_size=(-1, 0))  # noqa: E731
    with SimulatedGPU(flash_attn=False) as gpu:
        assert torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
        with pytest.raises(NotImplementedError, match="aten::_flash_attention_forward' with arguments from the 'CPU'"):
            call()
        q, k, v, cu = (x.to("cuda") for x in (q, k, v, cu))
        torch.testing.assert_close(call().float(), plain(q, k, v, cu, scale=16**-0.5).float(), atol=2e-2, rtol=2e-2)
        assert gpu.kernel_calls == {"aten::_flash_attention_forward": 1}
    assert not torch.cuda.is_available()
    with pytest.raises(NotImplementedError, match="'CPU' backend"):
        call()


def test_flash_attn_python_interface_is_the_real_one(emulated_gpu):
    """flash-attn's own `flash_attn_varlen_func` (sdist) pads head_dim 12 to 16 and runs the stand-in extension."""
    import flash_attn
    from flash_attn import flash_attn_varlen_func

    assert flash_attn.__version__ == "2.8.3" and "build/emulated" in flash_attn.__file__
    q, k, v, cu = (x.to("cuda") for x in inputs(dim=12))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu, cu, 9, 9, causal=True)
    out.float().sum().backward()
    ref = plain(q, k, v, cu, scale=12**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert all(x.grad is not None and x.grad.shape == x.shape for x in leaves)
    assert emulated_gpu.kernel_calls == {"flash_attn_2_cuda.varlen_fwd": 1, "flash_attn_2_cuda.varlen_bwd": 1}
