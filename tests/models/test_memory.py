"""The memory estimate: the largest step read from a real sampler plan and collator, activations measured on the
real model and extrapolated, a clear refusal when a step cannot fit, and the largest step that fits
(`max_tokens: auto`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import weakref

import numpy as np
import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger

from lit_packing.batch import COUNTS, IMAGE_KEYS, INPUT_IDS, StepShape
from lit_packing.data.collate import PackedCollator, PaddedCollator
from lit_packing.errors import ConfigError
from lit_packing.models import PackedCausalLM
from lit_packing.models.activations import activation_model, image_token_bytes, saved_activation_bytes, saved_bytes
from lit_packing.models.auto_size import choose_largest_fitting
from lit_packing.models.memory import (
    CPU_HEAP_RETENTION,
    MMAP_THRESHOLD_MAX,
    GiB,
    estimate_step_memory,
    memory_model,
)
from lit_packing.models.vlm import pack_vlm_documents, probe_documents
from lit_packing.samplers import BestFitPackingSampler, FixedLengthPackingSampler, RandomBatchSampler
from tests.conftest import TINY_CONFIGS
from tests.models.test_vlm_exact import CONFIGS as VLM_CONFIGS
from tests.models.test_vlm_exact import IMAGE as VLM_IMAGE

LENGTHS = np.array([100, 300, 50, 220, 180, 90, 400, 10])


def largest_step(sampler, collator) -> StepShape:
    """What the data module publishes as `DataContract.largest_step`: the collator's slots of the sampler's plan."""
    return collator.plan_slots(sampler.plan()).largest()


def test_largest_packed_step_is_the_fullest_pack():
    sampler = BestFitPackingSampler(LENGTHS, max_tokens=512, seed=0)
    packs = sampler.plan().packs()
    fullest = max(packs, key=lambda p: LENGTHS[p].sum())
    step = largest_step(sampler, PackedCollator())
    assert step == StepShape(int(LENGTHS[fullest].sum()), int((LENGTHS[fullest] ** 2).sum()), 1, step.width)
    # Bucketed, several packs pad to 1,024 slots: the step with the most attention pairs among them (tail padding
    # is one more segment) is the one that needs the most memory.
    bucketed = largest_step(sampler, PackedCollator(bucket_sizes=[256, 1024]))
    pairs = [(LENGTHS[p] ** 2).sum() + (1024 - LENGTHS[p].sum()) ** 2 for p in packs if LENGTHS[p].sum() > 256]
    assert bucketed.slot_tokens == 1024 and bucketed.attn_pairs == max(pairs)


def test_largest_padded_step_is_rows_times_longest():
    sampler = RandomBatchSampler(LENGTHS, batch_size=3, seed=0)
    batches = sampler.plan().packs()
    cost = [len(b) * LENGTHS[b].max() for b in batches]
    worst = batches[int(np.argmax(cost))]
    step = largest_step(sampler, PaddedCollator())
    assert step.padded and (step.rows, step.width) == (len(worst), int(LENGTHS[worst].max()))
    assert step.slot_tokens == max(cost) and step.attn_pairs == len(worst) * int(LENGTHS[worst].max()) ** 2


@pytest.mark.parametrize(
    "sampler, collator",
    [
        (BestFitPackingSampler(LENGTHS, max_tokens=512, seed=0), PackedCollator(pad_to_multiple_of=64)),
        (BestFitPackingSampler(LENGTHS, max_tokens=512, seed=0), PackedCollator(bucket_sizes=[300, 600])),
        (FixedLengthPackingSampler(LENGTHS, max_tokens=256, seed=0), PackedCollator(isolate=False, row_length=128)),
        (RandomBatchSampler(LENGTHS, batch_size=3, seed=0), PaddedCollator(pad_to_multiple_of=8)),
    ],
)
def test_plan_slots_equal_the_collated_batches_counts(sampler, collator):
    """The slot and attention arithmetic read from a plan is what the collator's real batches count, pack by pack."""
    slots = collator.plan_slots(sampler.plan())
    for p, pack in enumerate(sampler.plan().packs()):
        examples = [
            {INPUT_IDS: list(range(1, 1 + (item[2] - item[1] if isinstance(item, tuple) else LENGTHS[item])))}
            for item in pack
        ]
        counts = collator(examples)[COUNTS]
        assert (counts["slot_tokens"], counts["attn_cost"]) == (slots.slots[p], slots.pairs[p])


@pytest.mark.parametrize("padded", [False, True])
def test_activation_model_extrapolates_to_a_longer_step(padded):
    """Fitted on 64-256 tokens, the model predicts what autograd saves at 768 tokens within 5%."""
    torch.manual_seed(0)
    lm = PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=1000), attn_backend="per_example")
    a, b, c = activation_model(lm, padded)
    measured = saved_activation_bytes(lm, 768, padded)
    assert a + b * 768 + c * 768**2 == pytest.approx(measured, rel=0.05)
    assert b > 0


def test_the_probes_free_what_they_saved(monkeypatch):
    """Every activation a probe saved is freed with its forward (a pack hook that returned the saved tensor itself
    tied a node's saved output to that node, a cycle that leaked each probe's activations)."""
    torch.manual_seed(0)
    lm = PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=1000), attn_backend="per_example")
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks

    def recording(pack, unpack):
        def record(tensor):
            saved.append(weakref.ref(tensor))
            return pack(tensor)

        return hooks(record, unpack)

    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", recording)
    saved_activation_bytes(lm, 64, padded=False)
    weights = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    alive = [ref() for ref in saved if ref() is not None]
    assert saved and not [t for t in alive if t.untyped_storage().data_ptr() not in weights]


def test_gradient_checkpointing_and_chunked_loss_shrink_the_prediction():
    config = dict(TINY_CONFIGS["llama"], vocab_size=32000, num_hidden_layers=8)
    step = StepShape(8192, 8192 * 512, 1, 8192)
    predicted = {}
    for name, kwargs in {
        "full": {"loss_impl": "full"},
        "chunked": {},
        "chunked+checkpointing": {"gradient_checkpointing": True},
    }.items():
        torch.manual_seed(0)
        lm = PackedCausalLM(model_config=config, attn_backend="per_example", **kwargs)
        predicted[name] = estimate_step_memory(lm, step, "32-true")
    assert predicted["full"].logits == 8192 * 32000 * 16
    assert predicted["chunked"].logits == 1024 * 32000 * 16
    assert predicted["chunked+checkpointing"].activations < predicted["chunked"].activations / 2


def test_on_a_cpu_the_heap_the_allocator_keeps_is_counted_less_what_gradients_reuse():
    """A CPU process keeps a share of a step's freed activations and logits in its heap (glibc), and the step's
    gradients and the optimizer's copies then reuse part of it; a logits chunk of glibc's largest mmap threshold or
    more is mapped on its own and never kept (a 32,000-word vocabulary: 1,024 x 32,000 x 4 bytes = 125 MiB; 1,000
    words: 4 MiB, kept); a GPU's allocator is read as live tensors."""
    step = StepShape(4096, 4096, 1, 4096)
    for vocab, lora in ((32000, None), (32000, {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
                        (1000, None)):  # fmt: skip
        torch.manual_seed(0)
        lm = PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=vocab), lora=lora)
        memory = memory_model(lm, "32-true", padded=False)
        assert memory.heap_retention == CPU_HEAP_RETENTION
        cpu = memory.estimate(step)
        chunk = lm.hparams.loss_chunk_size * vocab * 4
        assert (chunk >= MMAP_THRESHOLD_MAX) == (vocab == 32000)
        kept = int(CPU_HEAP_RETENTION * (cpu.activations + (cpu.logits if vocab == 1000 else 0)))
        assert cpu.heap == max(0, kept - 2 * cpu.gradients) and "heap" in cpu.summary()
        gpu = dataclasses.replace(memory, heap_retention=0.0).estimate(step)
        assert gpu.heap == 0 and "heap" not in gpu.summary()
        assert cpu.peak == gpu.peak + cpu.heap  # 4,096 tokens: the backward's start is the peak
        if lora:
            assert cpu.heap > 0 and cpu.gradients < kept / 2  # with adapters: a few gradients, most of the heap kept


def test_a_step_that_cannot_fit_is_refused_with_the_knobs():
    torch.manual_seed(0)
    lm = PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=1000), loss_impl="full")
    estimate = estimate_step_memory(lm, StepShape(50_000_000, 50_000_000 * 1000, 1, 50_000_000), "32-true")
    assert not estimate.fits
    with pytest.raises(MemoryError) as err:
        estimate.check()
    message = str(err.value)
    assert "50,000,000 tokens in one packed row" in message
    for knob in ("data.sampler.init_args.max_tokens", "model.gradient_checkpointing=true", "model.loss_impl=chunked"):
        assert knob in message


# ---------------------------------------------------------------------------------------------------------------
# max_tokens: auto

LONGEST = 512
CANDIDATES = [2**k for k in range(10, 21)]  # 1,024 .. 1,048,576 tokens: each step ~2x the memory of the one before
CHOICE_LINE = re.compile(
    r"max_tokens: auto chose ([\d,]+) tokens per pack: predicted peak [\d.]+ GiB of a [\d.]+ GiB limit with a 25% "
    r"margin \(next candidate ([\d,]+): [\d.]+ GiB\)"
)


def pack_of(tokens: int) -> StepShape:
    """The worst-case packed step of `tokens`: one row, every example as long as the longest."""
    return StepShape(tokens, tokens * min(tokens, LONGEST), 1, tokens)


class Recorder(Logger):
    """A Lightning logger that keeps what it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[tuple[int | None, dict]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics, step=None) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


@pytest.fixture
def tiny_lm():
    torch.manual_seed(0)
    return PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=1000), attn_backend="per_example")


@pytest.fixture
def model_lines():
    """The lines `PackedCausalLM.largest_fitting` logs (`auto_size.largest_fitting`; the toolkit's logger may not
    propagate to pytest's)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("lit_packing.models.auto_size")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def attach(lm: PackedCausalLM) -> Recorder:
    """Attach a CPU trainer, as `configure_optimizers` runs under one; returns its logger."""
    recorder = Recorder()
    lm.trainer = Trainer(accelerator="cpu", devices=1, logger=recorder, enable_progress_bar=False)
    return recorder


def test_the_choice_is_the_largest_within_the_margin_and_monotone_in_the_limit(tiny_lm):
    memory = memory_model(tiny_lm, "32-true", padded=False)
    peaks = [memory.estimate(pack_of(c)).peak for c in CANDIDATES]
    assert peaks == sorted(peaks)
    # limits from below the smallest step's need to above the largest's, including each boundary exactly
    limits = sorted({*(p / 0.75 for p in peaks), *np.linspace(peaks[0] * 0.9, peaks[-1] * 1.5, 40)})
    chosen = []
    for limit in limits:
        choice = choose_largest_fitting(dataclasses.replace(memory, limit=int(limit)), pack_of, CANDIDATES, 0.25)
        budget = int(limit) * 0.75
        fitting = [c for c, p in zip(CANDIDATES, peaks) if p <= budget]
        assert choice.value == (fitting[-1] if fitting else None)  # the binary search finds the scan's answer
        if choice.value is not None:
            assert choice.estimate.peak <= budget and choice.estimate.step == pack_of(choice.value)
            if choice.following is not None:
                value, estimate = choice.following
                assert value == CANDIDATES[CANDIDATES.index(choice.value) + 1] and estimate.peak > budget
            else:
                assert choice.value == CANDIDATES[-1]
        else:
            assert choice.candidate == CANDIDATES[0] and choice.estimate.peak > budget
        chosen.append(-1 if choice.value is None else choice.value)
    assert chosen == sorted(chosen) and chosen[0] == -1 and chosen[-1] == CANDIDATES[-1]
    # a larger margin never chooses a larger step; another rank's smaller choice is taken (`agree`)
    middle = dataclasses.replace(memory, limit=math.ceil(peaks[6] / 0.75))
    margins = [choose_largest_fitting(middle, pack_of, CANDIDATES, m).value or 0 for m in (0.0, 0.25, 0.5, 0.9)]
    assert margins == sorted(margins, reverse=True) and margins[1] == CANDIDATES[6]
    assert choose_largest_fitting(middle, pack_of, CANDIDATES, 0.25, agree=lambda i: i - 2).value == CANDIDATES[4]
    assert choose_largest_fitting(middle, pack_of, CANDIDATES, 0.25, agree=lambda i: -1).value is None


def test_largest_fitting_probes_once_logs_the_choice_and_respects_memory_limit_gb(tiny_lm, model_lines):
    forwards = []
    tiny_lm.hf_model.base_model.register_forward_hook(lambda *args: forwards.append(1))
    recorder = attach(tiny_lm)
    memory = memory_model(tiny_lm, "32-true", padded=False)
    peaks = [memory.estimate(pack_of(c)).peak for c in CANDIDATES]
    choices = []
    for target in (7, 5, 2):  # each limit halfway between two candidates' needs: the process's drift cannot matter
        tiny_lm.hparams.memory_limit_gb = (peaks[target] + peaks[target + 1]) / 2 / 0.75 / GiB
        forwards.clear()
        value, estimate = tiny_lm.contract.largest_fitting(pack_of, CANDIDATES, what="max_tokens")
        assert len(forwards) == 3  # the three probes, once for every candidate
        assert value == CANDIDATES[target] and estimate.step == pack_of(value)
        assert estimate.peak <= tiny_lm.hparams.memory_limit_gb * GiB * 0.75 and estimate.capped
        match = CHOICE_LINE.fullmatch(model_lines[-1])
        assert match and match[1] == f"{value:,}" and match[2] == f"{CANDIDATES[target + 1]:,}"
        assert recorder.metrics[-1] == (0, {"train/auto_max_tokens": float(value)})
        choices.append(value)
    assert choices == sorted(choices, reverse=True)  # a lower memory_limit_gb, a smaller step


def test_largest_fitting_returns_none_when_nothing_fits(tiny_lm, model_lines):
    tiny_lm.hparams.memory_limit_gb = 0.01  # less than the process holds
    recorder = attach(tiny_lm)
    value, estimate = tiny_lm.largest_fitting(pack_of, CANDIDATES, what="batch_size")  # the data side's call
    assert value is None and estimate.step == pack_of(CANDIDATES[0]) and not estimate.fits
    assert model_lines[-1].startswith(
        "batch_size: auto found no value that fits: the smallest candidate, 1,024 examples per batch, is predicted"
    )
    assert not recorder.metrics
    with pytest.raises(ValueError, match="increasing"):
        tiny_lm.largest_fitting(pack_of, [2048, 1024])


def test_memory_limit_gb_caps_the_memory_check(tiny_lm):
    step = pack_of(65536)
    free = estimate_step_memory(tiny_lm, step, "32-true")
    assert free.fits and not free.capped and free.limit == free.resident + free.available
    tiny_lm.hparams.memory_limit_gb = 1e6  # more than the device has: the device's memory stays the limit
    assert not estimate_step_memory(tiny_lm, step, "32-true").capped
    tiny_lm.hparams.memory_limit_gb = free.peak * 0.9 / GiB
    capped = estimate_step_memory(tiny_lm, step, "32-true")
    assert capped.capped and not capped.fits
    with pytest.raises(MemoryError, match=r"a higher model\.memory_limit_gb \(now [\d.]+\)"):
        capped.check()


@pytest.mark.parametrize(
    "setting, value, problem",
    [
        ("memory_limit_gb", 0, "model.memory_limit_gb: must be > 0"),
        ("memory_limit_gb", -2.0, "model.memory_limit_gb: must be > 0"),
        ("memory_limit_gb", math.inf, "model.memory_limit_gb: must be a finite number"),
        ("memory_margin", 1.0, "model.memory_margin: must be < 1"),
        ("memory_margin", -0.1, "model.memory_margin: must be >= 0"),
    ],
)
def test_memory_settings_are_range_checked(setting, value, problem):
    with pytest.raises(ConfigError, match=re.escape(problem)):
        PackedCausalLM(model_config=dict(TINY_CONFIGS["llama"], vocab_size=1000), **{setting: value})


# ---------------------------------------------------------------------------------------------------------------
# vision-language models


def vision_lm(family: str) -> PackedCausalLM:
    torch.manual_seed(0)
    return PackedCausalLM(model_config={"model_type": family, **VLM_CONFIGS[family]}, attn_backend="per_example")


@pytest.mark.parametrize("family", ["idefics3", "qwen2_vl", "llava"])
def test_a_vlm_measures_its_towers_activations_per_image_token(family):
    """Measured on the probe documents (3 images), the bytes per image token predict within 5% what the tower and
    connector keep for 6 documents with 9 images: the saved bytes with the images less those of the same tokens
    without them."""
    lm = vision_lm(family)
    per_token = image_token_bytes(lm)
    assert per_token > 0
    batch = pack_vlm_documents(lm.hf_model, probe_documents(lm.hf_model.config, seed=1)[1:] * 3)
    text = {key: value for key, value in batch.items() if key not in IMAGE_KEYS}
    tokens = int((batch[INPUT_IDS] == VLM_IMAGE).sum())
    assert saved_bytes(lm, batch) - saved_bytes(lm, text) == pytest.approx(per_token * tokens, rel=0.05)


def test_a_vlm_step_counts_its_slots_as_image_tokens_and_a_text_model_none(tiny_lm):
    lm = vision_lm("idefics3")
    memory = memory_model(lm, "32-true", padded=False)
    step = StepShape(1024, 1024 * 128, 1, 1024)
    estimate = memory.estimate(step)
    assert estimate.vision == int(memory.image_token_bytes * 1024) > 0
    assert memory.image_token_bytes == pytest.approx(image_token_bytes(lm))
    without = dataclasses.replace(memory, image_token_bytes=0.0).estimate(step)
    assert estimate.peak - without.peak == estimate.vision + estimate.heap - without.heap
    kept = estimate.activations + estimate.vision + estimate.logits  # a 300-word vocabulary: logits kept too
    assert estimate.heap == max(0, int(CPU_HEAP_RETENTION * kept) - 2 * estimate.gradients)
    assert re.search(r"activations [\d.]+, vision [\d.]+, logits", estimate.summary())
    assert "vision" not in without.summary()
    text = memory_model(tiny_lm, "32-true", padded=False)
    assert text.image_token_bytes == 0.0 and text.estimate(step).vision == 0
