"""PackedCausalLM with a real Trainer: the step's gradient is the global mean whatever the packing, padding,
accumulation; validation agrees packed vs padded; the guards stop contaminated batches."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from lit_packing.batch import attach_step
from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.models import IsolationError, PackedCausalLM, check_isolation
from lit_packing.models.loss import causal_lm_loss, per_example_losses, token_losses
from tests.helpers import broken_backend, launch, make_examples

LENGTHS = [9, 4, 15, 6, 6, 11, 2, 8]


def make_lm(config, **kwargs) -> PackedCausalLM:
    torch.manual_seed(0)
    kwargs.setdefault("lr", 0.0)
    return PackedCausalLM(model_config=config, **kwargs)


# The gradient tests run in float64: in fp32, summation order alone moves a gradient element by up to ~1e-5 of its
# tensor's scale. (transformers still computes RMSNorm and RoPE in fp32, so fp64 agrees to ~1e-7 of the scale, not
# 1e-16.) A mean-of-means or a miscounted step changes gradients by percents.
FP64 = "64-true"


def run_one_step(lm, batches, accumulate, **trainer_kwargs):
    """One optimizer step over `batches` (micro-batches, given the step's totals as the samplers do) with a real
    Trainer; the gradients it stepped with."""
    batches = attach_step(batches)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        accumulate_grad_batches=accumulate,
        logger=False,
        precision=trainer_kwargs.pop("precision", FP64),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(lm, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    return {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}, trainer.callback_metrics


def chunks(examples, sizes):
    out, start = [], 0
    for size in sizes:
        out.append(examples[start : start + size])
        start += size
    return out


def reference(config, examples, normalization="token"):
    """Each example alone through the model, the objective by hand: token mean or mean of example means."""
    lm = make_lm(config).double()
    sums, counts = [], []
    for ex in examples:
        logits = lm.model(input_ids=torch.tensor([ex["input_ids"]]), use_cache=False).logits
        losses, mask, _ = token_losses(logits, torch.tensor([ex["labels"]]))
        sums.append(losses.sum())
        counts.append(mask.sum())
    sums, counts = torch.stack(sums), torch.stack(counts).double()
    if normalization == "token":
        loss = sums.sum() / counts.sum()
    else:
        has = counts > 0
        loss = (sums[has] / counts[has]).mean()
    loss.backward()
    token_mean = (sums.sum() / counts.sum()).detach()
    return {n: p.grad.clone() for n, p in lm.named_parameters()}, token_mean


def assert_grads_close(grads, ref):
    for name, grad in ref.items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(grads[name], grad, atol=1e-6 * scale, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


LAYOUTS = {
    "packed, 1 micro-batch": ("packed", [8], 1),
    "packed, 4 micro-batches": ("packed", [2, 3, 1, 2], 4),
    "packed differently, 2 micro-batches": ("packed", [5, 3], 2),
    "padded, 4 micro-batches": ("padded", [3, 1, 2, 2], 4),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_loss_gradient_independent_of_packing(tiny_llama_config, layout):
    kind, sizes, accumulate = LAYOUTS[layout]
    examples = make_examples(LENGTHS)
    collate = PackedCollator() if kind == "packed" else PaddedCollator(pad_token_id=0)
    lm = make_lm(tiny_llama_config)
    grads, metrics = run_one_step(lm, [collate(c) for c in chunks(examples, sizes)], accumulate)
    ref_grads, ref_loss = reference(tiny_llama_config, examples)
    assert_grads_close(grads, ref_grads)
    torch.testing.assert_close(metrics["train/loss"].double(), ref_loss, atol=0, rtol=1e-9)


def test_batches_without_step_totals_are_refused_under_accumulation(tiny_llama_config):
    """Without the step's totals a micro-batch cannot know its share of the step: a clear error, not a mean of means."""
    collate = PackedCollator()
    batches = [collate(c) for c in chunks(make_examples(LENGTHS), [4, 4])]
    trainer = Trainer(accelerator="cpu", max_steps=1, accumulate_grad_batches=2, logger=False, barebones=True)
    with pytest.raises(ValueError, match="attach_step"):
        trainer.fit(make_lm(tiny_llama_config), DataLoader(batches, batch_size=None, collate_fn=lambda b: b))


class GradientRecorder(Callback):
    """What a gradient-norm callback sees (before clipping), and what the optimizer steps with (after clipping)."""

    def on_train_start(self, trainer, pl_module):
        def record(optimizer, args, kwargs):
            self.stepped = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}

        trainer.optimizers[0].register_step_post_hook(record)  # the closure runs inside step()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def test_callbacks_see_normalised_gradients_and_clipping_clips_them(tiny_llama_config):
    examples = make_examples(LENGTHS)
    ref_grads, _ = reference(tiny_llama_config, examples)
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads.values()]))
    recorder = GradientRecorder()
    collate = PackedCollator()
    run_one_step(
        make_lm(tiny_llama_config),
        [collate(c) for c in chunks(examples, [3, 5])],
        2,
        callbacks=[recorder],
        gradient_clip_val=float(ref_norm) / 2,
    )
    assert_grads_close(recorder.seen, ref_grads)  # the global token mean, before any clipping
    stepped_norm = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g) for g in recorder.stepped.values()])
    )
    torch.testing.assert_close(stepped_norm, ref_norm / 2, rtol=1e-5, atol=0)  # clipping was hit, on that gradient
    assert_grads_close(recorder.stepped, {n: g / 2 for n, g in ref_grads.items()})


@pytest.mark.parametrize(
    "accelerator, precision",
    # Lightning runs fp16 AMP on CUDA only (on CPU it silently switches 16-mixed to bf16-mixed).
    [("cpu", "bf16-mixed"), pytest.param("gpu", "16-mixed", marks=pytest.mark.cuda)],
)
def test_mixed_precision_steps_run(tiny_llama_config, accelerator, precision):
    collate = PackedCollator()
    lm = make_lm(tiny_llama_config, lr=1e-3)
    trainer = Trainer(
        accelerator=accelerator,
        max_steps=2,
        accumulate_grad_batches=2,
        precision=precision,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    batches = attach_step([collate(c) for c in chunks(make_examples(LENGTHS), [4, 4])]) * 2
    trainer.fit(lm, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    assert trainer.global_step == 2 and math.isfinite(float(trainer.callback_metrics["train/loss"]))
    assert all(torch.isfinite(p).all() for p in lm.parameters())


def test_empty_pack_contributes_nothing(tiny_llama_config):
    """A rank with nothing left gets a 1-token pack with no labels: same gradient as without it."""
    examples = make_examples(LENGTHS)
    collate = PackedCollator()
    batches = [collate(examples[:4]), collate([]), collate(examples[4:])]
    assert batches[1]["counts"]["label_tokens"] == 0
    grads, _ = run_one_step(make_lm(tiny_llama_config), batches, 3)
    assert_grads_close(grads, reference(tiny_llama_config, examples)[0])


@pytest.mark.parametrize("kind", ["packed", "padded"])
def test_sequence_normalization_matches_hand_computation(tiny_llama_config, kind):
    examples = make_examples(LENGTHS)
    examples[2]["labels"] = [-100] * len(examples[2]["labels"])  # no labels: not counted as an example
    collate = PackedCollator(pad_to_multiple_of=16) if kind == "packed" else PaddedCollator(pad_token_id=0)
    lm = make_lm(tiny_llama_config, loss_normalization="sequence")
    grads, metrics = run_one_step(lm, [collate(c) for c in chunks(examples, [3, 5])], 2)
    ref_grads, token_mean = reference(tiny_llama_config, examples, "sequence")
    assert_grads_close(grads, ref_grads)
    torch.testing.assert_close(metrics["train/loss"].double(), token_mean, atol=0, rtol=1e-9)


def test_sequence_loss_with_rows_spanning_examples():
    """The contaminated fixed-length collator: attention rows (cu_seq_lens) != examples (seq_idx); still per example."""
    examples = [{"input_ids": list(range(1, n + 1)), "labels": list(range(1, n + 1))} for n in (5, 3, 6)]
    batch = PackedCollator(isolate=False, row_length=8)(examples)
    assert batch["cu_seq_lens_q"].tolist() == [0, 8, 14] and int(batch["seq_idx"].max()) == 2
    logits = torch.randn(1, 14, 16)
    parts = causal_lm_loss(logits, batch, "sequence")
    losses, mask, _ = token_losses(logits, batch["labels"])
    per_token = losses[0] * mask[0]
    means = [per_token[a:b].sum() / mask[0, a:b].sum() for a, b in ((0, 4), (4, 7), (7, 13))]  # targets shift by 1
    torch.testing.assert_close(parts.objective, sum(means))
    assert parts.normalizer.item() == 3


def test_sequence_loss_parts_by_hand():
    """Two examples, per-token losses known: the objective is the sum of the two example means."""
    vocab = 4
    logits = torch.zeros(1, 6, vocab)  # uniform: every token loss is log(4)
    logits[0, 0, 1] = 10.0  # position 0 predicts token 1 almost surely
    labels = torch.tensor([[-100, 1, 2, -100, 3, 0]])
    batch = {"labels": labels, "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1]]), "cu_seq_lens_q": torch.tensor([0, 3, 6])}
    parts = causal_lm_loss(logits, batch, "sequence")
    first = (torch.nn.functional.cross_entropy(logits[0, 0:1], labels[0, 1:2]) + torch.log(torch.tensor(4.0))) / 2
    second = torch.log(torch.tensor(4.0))  # two tokens, both log(4)
    torch.testing.assert_close(parts.objective, first + second)
    assert parts.normalizer.item() == 2 and parts.label_tokens.item() == 4


def test_validation_packed_equals_unpacked(tiny_llama_config):
    examples = make_examples(LENGTHS)
    lm = make_lm(tiny_llama_config)
    results = {}
    for kind, collate in {"packed": PackedCollator(), "padded": PaddedCollator(pad_token_id=0)}.items():
        loader = DataLoader([collate(c) for c in chunks(examples, [3, 5])], batch_size=None, collate_fn=lambda b: b)
        trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
        results[kind] = trainer.validate(lm, loader, verbose=False)[0]
    _, token_mean = reference(tiny_llama_config, examples)
    for kind in results:
        assert results[kind]["val/loss"] == pytest.approx(token_mean.item(), rel=1e-5)
        assert results[kind]["val/perplexity"] == pytest.approx(token_mean.exp().item(), rel=1e-5)
    assert results["packed"]["val/token_accuracy"] == results["padded"]["val/token_accuracy"]

    # per-example losses: packed == each example alone
    batch = PackedCollator()(examples)
    with torch.no_grad():
        losses, mask, _ = token_losses(lm(batch), batch["labels"])
        sums, counts = per_example_losses(losses, mask, batch["seq_idx"].long(), len(examples))
        for i, ex in enumerate(examples):
            alone, alone_mask, _ = token_losses(
                lm.model(input_ids=torch.tensor([ex["input_ids"]])).logits, torch.tensor([ex["labels"]])
            )
            torch.testing.assert_close(sums[i], alone.sum(), atol=1e-5, rtol=1e-5)
            assert counts[i] == alone_mask.sum()


# ---------------------------------------------------------------------------------------------------------------
# Guards


def test_fit_stops_before_first_step_on_broken_backend(tiny_llama_config, monkeypatch):
    monkeypatch.setattr("lit_packing.models.pack.attn_implementation", lambda backend: broken_backend())
    lm = make_lm(tiny_llama_config, lr=1e-3)
    before = {n: p.detach().clone() for n, p in lm.named_parameters()}
    with pytest.raises(IsolationError, match="isolation self-test failed"):
        run_one_step(lm, [PackedCollator()(make_examples(LENGTHS))], 1)
    for name, param in lm.named_parameters():
        assert torch.equal(param, before[name]), name
    # switched off: the (broken) run goes ahead
    lm = make_lm(tiny_llama_config, isolation_check=False)
    run_one_step(lm, [PackedCollator()(make_examples(LENGTHS))], 1)


# ---------------------------------------------------------------------------------------------------------------
# Knobs


def test_weight_decay_groups_and_schedule(tiny_llama_config):
    from lit_packing.models.optim import lr_schedule

    lm = make_lm(tiny_llama_config, weight_decay=0.1, lr=1e-3)
    trainer = Trainer(accelerator="cpu", max_steps=10, logger=False)
    lm.trainer = trainer
    config = lm.configure_optimizers()
    decay, no_decay = config["optimizer"].param_groups
    names = {id(p): n for n, p in lm.named_parameters()}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 2 and "embed" not in names[id(p)] for p in decay["params"])
    assert any("embed_tokens" in names[id(p)] for p in no_decay["params"])
    assert any("norm" in names[id(p)] for p in no_decay["params"])
    cosine = lr_schedule("cosine", warmup_steps=2, total_steps=10)
    assert [round(cosine(s), 4) for s in (0, 1, 2, 6, 10)] == [0.5, 1.0, 1.0, 0.5, 0.0]
    assert lr_schedule("linear", 0, 10, min_lr_ratio=0.1)(10) == pytest.approx(0.1)


def test_lora_gradient_checkpointing_and_export(tiny_llama_config, tmp_path):
    lm = make_lm(
        tiny_llama_config,
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        gradient_checkpointing=True,
        export_dir=str(tmp_path / "export"),
        lr=1e-3,
    )
    trainable = {n for n, p in lm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    grads, _ = run_one_step(lm, [PackedCollator()(make_examples(LENGTHS))], 1)
    assert set(grads) == trainable
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)  # lora_A's gradient is 0: B starts at 0
    merged = tmp_path / "export"  # the model the adapters amount to, for plain transformers
    assert (merged / "config.json").exists() and (merged / "model.safetensors").exists()
    assert not (merged / "adapter_config.json").exists()
    lm.hparams.export_adapters_only = True
    lm.export(str(tmp_path / "adapters"))
    assert (tmp_path / "adapters" / "adapter_config.json").exists()


def test_export_full_model_reloads(tiny_llama_config, tmp_path):
    from transformers import AutoModelForCausalLM

    lm = make_lm(tiny_llama_config)
    umask = os.umask(0o022)
    try:
        lm.export(str(tmp_path))
    finally:
        os.umask(umask)
    assert oct((tmp_path / "model.safetensors").stat().st_mode & 0o777) == oct(0o644)  # readable like its folder
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config._attn_implementation in ("sdpa", "eager")  # our backend is not baked into the export
    batch = PackedCollator()(make_examples(LENGTHS[:2]))
    ids = batch["input_ids"][:, : LENGTHS[0]]
    torch.testing.assert_close(reloaded(input_ids=ids).logits, lm.model(input_ids=ids).logits)


def test_pretrained_model_starts_in_train_mode(tiny_llama_config, tmp_path):
    # from_pretrained hands back eval mode; training must not silently run with dropout off.
    make_lm(tiny_llama_config).model.save_pretrained(tmp_path)
    lm = PackedCausalLM(name_or_path=str(tmp_path))
    assert all(module.training for module in lm.model.modules())


def test_model_without_attention_interface_is_refused_at_start():
    bloom = dict(model_type="bloom", vocab_size=1000, hidden_size=64, n_layer=2, n_head=4)
    with pytest.raises(ValueError, match="BloomForCausalLM.*AttentionInterface"):
        PackedCausalLM(model_config=bloom)


def test_pretrained_vocab_mismatch_is_a_clear_error(tiny_llama_config, tmp_path):
    make_lm(tiny_llama_config).model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="resize_embeddings"):
        PackedCausalLM(name_or_path=str(tmp_path), vocab_size=60_000)
    lm = PackedCausalLM(name_or_path=str(tmp_path), vocab_size=60_000, resize_embeddings=True)
    assert lm.model.get_input_embeddings().weight.shape[0] >= 60_000


def test_bf16_mixed_with_clipping_logs_train_loss_in_progress_bar(tiny_llama_config):
    lm = make_lm(tiny_llama_config, lr=1e-3)
    trainer = Trainer(
        accelerator="cpu",
        max_steps=2,
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    batches = attach_step([PackedCollator()(make_examples(LENGTHS))]) * 2
    trainer.fit(lm, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    assert math.isfinite(float(trainer.progress_bar_metrics["train/loss"]))  # shown in the progress bar


DDP_SCRIPT = """
import torch
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader
from lit_packing.batch import attach_step
from lit_packing.data.collate import PackedCollator
from lit_packing.models import PackedCausalLM
from lit_packing.models.loss import token_losses

CONFIG = {config!r}
LENGTHS = {lengths!r}
gen = torch.Generator().manual_seed(0)
examples = []
for n in LENGTHS:
    ids = torch.randint(3, 1000, (n,), generator=gen).tolist()
    examples.append({{"input_ids": ids, "labels": [-100] * (n // 3) + ids[n // 3:]}})
# 4 micro-batches of unequal size: rank 0 gets the 1st and 3rd, rank 1 the 2nd and 4th (accumulate 2)
# (every micro-batch carries the step's global totals, as the samplers give them)
batches = attach_step([PackedCollator()(examples[a:b]) for a, b in [(0, 2), (2, 5), (5, 6), (6, 8)]])

class Recording(PackedCausalLM):
    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.grads = {{n: p.grad.clone() for n, p in self.named_parameters()}}

torch.manual_seed(0)
lm = Recording(model_config=CONFIG, lr=0.0)
trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, accumulate_grad_batches=2,
                  precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
trainer.fit(lm, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
if trainer.is_global_zero:
    torch.manual_seed(0)
    ref = PackedCausalLM(model_config=CONFIG).double()
    sums, count = 0, 0
    for ex in examples:
        logits = ref.model(input_ids=torch.tensor([ex["input_ids"]]), use_cache=False).logits
        losses, mask, _ = token_losses(logits, torch.tensor([ex["labels"]]))
        sums, count = sums + losses.sum(), count + mask.sum()
    (sums / count).backward()
    err = max(((lm.grads[n] - p.grad).abs().max() / p.grad.abs().max()).item() for n, p in ref.named_parameters())
    assert err < 1e-5, err
    assert abs(trainer.callback_metrics["train/loss"].item() - (sums / count).item()) < 1e-9
    print("DDP-OK", err)
"""


@pytest.mark.slow
def test_ddp_two_ranks_with_accumulation_gives_the_global_token_mean(tiny_llama_config, tmp_path):
    """2 CPU ranks (gloo) x 2 micro-batches of unequal size: the step's gradient is the global per-token mean."""
    script = tmp_path / "ddp_check.py"
    script.write_text(DDP_SCRIPT.format(config=tiny_llama_config, lengths=LENGTHS))
    done = launch.run([sys.executable, str(script)], cwd=tmp_path, timeout=300)
    assert "DDP-OK" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


@pytest.mark.slow
def test_real_smollm2_packed_equals_per_example(smollm2_tokenizer):
    """The packaged SmolLM2-135M (30 layers, GQA 9/3): packed per_example logits == each chat alone, in fp32."""
    lm = PackedCausalLM(name_or_path="smollm2", vocab_size=len(smollm2_tokenizer))
    chats = ["What is 2 + 2?", "Prove that the square root of 2 is irrational.", "Hi", "Factor x^2 - 5x + 6."]
    examples = [{"input_ids": ids, "labels": ids} for ids in smollm2_tokenizer(chats)["input_ids"]]
    diff = check_isolation(lm.model, PackedCollator()(examples), lm.attn_backend)
    assert lm.attn_backend == "per_example" and diff < 1e-3


@pytest.mark.cuda
def test_fsdp_step_gives_the_global_token_mean(tiny_llama_config):
    """Lightning's FSDP needs a GPU: one GPU, 2 micro-batches; the sharded step's gradient norm and loss equal the
    per-example reference (FSDP reduces gradients like DDP, so the same normalisation holds on more GPUs)."""
    examples = make_examples(LENGTHS)
    batches = attach_step([PackedCollator()(c) for c in chunks(examples, [3, 5])])

    class Recording(PackedCausalLM):
        def on_before_optimizer_step(self, optimizer):
            super().on_before_optimizer_step(optimizer)
            local = sum(p.grad.double().pow(2).sum() for p in self.parameters() if p.grad is not None)
            self.norm = self.trainer.strategy.reduce(local, reduce_op="sum").sqrt().item()

    torch.manual_seed(0)
    lm = Recording(model_config=tiny_llama_config, lr=0.0)
    trainer = Trainer(
        accelerator="gpu", devices=1, strategy="fsdp", max_steps=1, accumulate_grad_batches=2, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(lm, DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    ref_grads, ref_loss = reference(tiny_llama_config, examples)
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads.values()]))
    assert lm.norm == pytest.approx(float(ref_norm), rel=1e-3)
    assert float(trainer.callback_metrics["train/loss"]) == pytest.approx(float(ref_loss), rel=1e-4)
