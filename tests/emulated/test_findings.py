"""What the GPU path got wrong, each fixed and guarded on the simulated GPU machine: building the model, one dtype
for q / k / v under autocast, no logging or imports inside traced code, head_dim padding, liger with no label,
a flash-attn that is there but does not load, `auto` that knows what each kernel refuses, FA3 / FA4 choice."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader

from lit_packing.data.collate import PackedCollator
from lit_packing.errors import ConfigError, IsolationError
from lit_packing.models import PackedCausalLM, attention, check_isolation, kernels
from lit_packing.models.backends import resolve_backend, select_varlen_impl
from lit_packing.models.kernels import flash_attn_status
from lit_packing.models.loss import HeadInputs, causal_lm_loss
from lit_packing.models.pack import pack_model
from tests.emulated.machine import SimulatedGPU
from tests.emulated.test_backends import EXAMPLES, FAMILIES, MODEL_KEYS
from tests.helpers import make_examples, tiny_model

CUDA = torch.device("cuda", 0)
OPS = {
    "flash_attn": ("flash_attn_2_cuda.varlen_fwd", "flash_attn_2_cuda.varlen_bwd"),
    "torch_varlen": ("aten::_flash_attention_forward", "aten::_flash_attention_backward"),
}


def small_lm(family="llama", **kwargs) -> PackedCausalLM:
    torch.manual_seed(0)
    return PackedCausalLM(model_config=dict(FAMILIES[family]), **kwargs)


def fit_steps(lm: PackedCausalLM, precision: str, steps: int = 2, **trainer) -> Trainer:
    """A few packed steps through Lightning's CUDA accelerator on the simulated machine."""
    collate = PackedCollator()
    batches = [collate(make_examples([9, 3, 12, 9, 1, 6], seed=i)) for i in range(steps)]
    trainer = Trainer(
        accelerator="gpu", devices=1, precision=precision, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **trainer,
    )  # fmt: skip
    trainer.fit(lm, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    return trainer


# 1. The model is built on the host: its construction-time forward must not call a GPU kernel there.


@pytest.mark.parametrize("flash", [True, False])
def test_the_model_builds_on_a_gpu_machine_and_trains_with_its_gpu_kernel(flash, caplog):
    with SimulatedGPU(flash_attn=flash) as gpu:
        lm = small_lm()  # loss_impl=chunked: checks the head on 8 tokens at construction, on the host
        assert lm.attn_backend == "per_example"  # what the host runs, until the strategy moves the model
        with caplog.at_level(logging.INFO, logger="lit_packing"):
            fit_steps(lm, "bf16-mixed")
    backend = "flash_attn" if flash else "torch_varlen"
    assert lm.attn_backend == backend
    assert gpu.kernel_calls[OPS[backend][0]] > 0 and gpu.kernel_calls[OPS[backend][1]] > 0
    lines = [r.getMessage() for r in caplog.records]
    assert f"attention backend: {backend} (auto" in "\n".join(lines)
    assert any(line.startswith(f"isolation self-test passed: attn_backend={backend}") for line in lines)


# 2. Under autocast transformers hands attention fp32 q / k (RoPE) and a half v: one dtype for all three.


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ["flash_attn", "torch_varlen"])
def test_autocast_q_k_v_of_mixed_dtypes_run_in_the_autocast_dtype(backend, dtype, caplog):
    with SimulatedGPU(flash_attn=backend == "flash_attn"):
        model = tiny_model(FAMILIES["llama"]).to("cuda").eval()
        pack_model(model, backend, "cuda")
        batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in PackedCollator()(EXAMPLES).items()}
        layer = model.model.layers[0].self_attn
        with torch.no_grad(), torch.autocast("cuda", dtype=dtype), caplog.at_level(logging.WARNING):
            logits = model(**{k: batch[k] for k in MODEL_KEYS}, use_cache=False).logits
            q = torch.randn(1, 4, 10, 16)  # (B, H, T, D) fp32, as RoPE leaves q and k
            v = torch.randn(1, 2, 10, 16, dtype=dtype)
            cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
            kernel = {"flash_attn": kernels.flash_attn_varlen, "torch_varlen": kernels.torch_varlen}[backend]
            out, _ = attention._attention_forward(kernel)(
                layer, q, q[:, :2].clone(), v, None, scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu
            )
    assert torch.isfinite(logits).all()
    assert out.dtype == dtype  # the kernel's own output: no fp32 (T, H, D) copy per layer under autocast
    assert not [r for r in caplog.records if "computes in bfloat16" in r.getMessage()]  # nothing false said


# 3. No logging inside traced code, and the warning where it is true: once, at setup.


def test_fp32_training_on_a_half_only_kernel_warns_once_at_setup_and_judges_by_bf16(caplog):
    with SimulatedGPU():
        lm = small_lm()
        with caplog.at_level(logging.WARNING, logger="lit_packing"):
            fit_steps(lm, "32-true", steps=2)
        warnings = [r.getMessage() for r in caplog.records if "computes in bfloat16" in r.getMessage()]
        assert warnings == [warnings[0]] and "float32 activations are cast to bfloat16" in warnings[0]
        batch = {k: v.to("cuda") if torch.is_tensor(v) else v for k, v in PackedCollator()(EXAMPLES).items()}
        diff = check_isolation(lm.model, batch, "flash_attn")  # passes, judged at bf16's tolerance ...
        assert diff > 1e-4
        with pytest.raises(IsolationError):  # ... which, at fp32's, would fail this correct backend
            check_isolation(lm.model, batch, "flash_attn", rtol=1e-4)


# A compiled decoder traces whole, its graphs calling the kernels: test_fit's compiled fits (graph breaks counted
# over a whole fit of configs/gpu.yaml with `compile: true`, kernel calls counted per step).


# 4. head_dim 12 on torch_varlen: test_backends' llama_head_dim_12 cases (the kernel takes multiples of 8 only).


def test_torch_varlen_pads_a_head_dim_that_is_not_a_multiple_of_8(emulated_gpu_without_flash_attn):
    q, k, v = (torch.randn(10, h, 12, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device="cuda")
    opts = {"causal": True, "scale": 12**-0.5, "window": None, "softcap": None, "dropout": 0.0}
    out = kernels.torch_varlen(q, k, v, cu, cu, 6, 6, **opts)
    ref = kernels.per_example_varlen(q.float(), k.float(), v.float(), cu, cu, 6, 6, **opts)
    assert out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


# 5. liger on a micro-batch with no trained token (an empty pack, an all-prompt pack).


def test_liger_loss_of_a_micro_batch_without_labels_is_zero_and_keeps_the_graph():
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(1, 6, 16, requires_grad=True)
    labels = torch.full((1, 6), -100)
    parts = causal_lm_loss(HeadInputs(hidden, head, impl="liger"), {"labels": labels}, "token")
    assert float(parts.token_loss_sum) == 0.0 and float(parts.label_tokens) == 0.0
    parts.objective.backward()  # every rank runs the same backward (DDP's reducer waits for every parameter)
    assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) == 0.0


# 6. flash-attn present but unusable: a real import decides, `auto` falls back, the reason is one line.


BROKEN_INSTALLS = {
    "fa4_only": {"flash_attn/cute/__init__.py": ""},  # a namespace package `flash_attn` without the FA2 kernels
    "extension_does_not_load": {
        "flash_attn/__init__.py": "from flash_attn.flash_attn_interface import flash_attn_varlen_func\n",
        "flash_attn/flash_attn_interface.py": "import flash_attn_2_cuda as flash_attn_gpu\n",
        "flash_attn_2_cuda.py": "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDev')\n",
    },
}


@pytest.mark.parametrize("install", sorted(BROKEN_INSTALLS))
def test_a_flash_attn_that_does_not_load_is_not_chosen(install, tmp_path, monkeypatch):
    for path, text in BROKEN_INSTALLS[install].items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    with SimulatedGPU(flash_attn=False):
        del sys.modules["flash_attn"]  # the machine hides flash-attn; this install is the one it has
        usable, why = flash_attn_status()
        assert not usable and "installed but its varlen kernel does not load" in why
        assert resolve_backend("auto", "cuda") == "torch_varlen"
        with pytest.raises(ConfigError) as error:
            resolve_backend("flash_attn", "cuda")
        sys.modules.pop("flash_attn_2_cuda", None)
    assert "does not load" in str(error.value) and "\n" not in str(error.value)


# 7. `auto` knows what each kernel refuses: Gemma 2's softcap on a GPU without flash-attn.


def test_auto_skips_a_kernel_the_model_needs_more_than(emulated_gpu_without_flash_attn, caplog):
    with caplog.at_level(logging.INFO, logger="lit_packing"):
        lm = small_lm("gemma2")
        assert lm.packing.to_device(lm.model, CUDA) == "per_example"
    assert any("torch_varlen has no softcap (Gemma2ForCausalLM)" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError) as error:
        small_lm("gemma2", attn_backend="torch_varlen")
    message = str(error.value)
    assert message.startswith("model.attn_backend: Gemma2ForCausalLM cannot run on attn_backend=torch_varlen")
    assert "torch_varlen has no softcap" in message and "model.attn_backend=auto" in message


def test_auto_takes_flash_attn_for_softcap_when_it_is_there(emulated_gpu):
    lm = small_lm("gemma2")
    assert lm.packing.to_device(lm.model, CUDA) == "flash_attn"


# FA3 / FA4 for torch_varlen, where PyTorch offers them.


def test_varlen_impl_auto_keeps_fa2_without_newer_packages_and_an_asked_one_is_refused_in_one_line(
    emulated_gpu_without_flash_attn,
):
    assert select_varlen_impl("auto", CUDA) == "FA2"
    with pytest.raises(ConfigError) as error:
        select_varlen_impl("FA3", CUDA)
    message = str(error.value)
    assert message.startswith("varlen_impl: torch_varlen cannot run FA3 here (FA3: ") and "\n" not in message
