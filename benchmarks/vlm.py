"""Packed against padded image chats, side by side in one run: tokens/s, padding, peak host memory, losses.

One flattened row (lit_packing) against the Hugging Face Trainer's padded batch of the same chats, step by step.

    python -m benchmarks.vlm            # smolvlm-tiny (SmolLM2-135M + a 2-layer vision tower), 4 chats a step
    python -m benchmarks.vlm --tiny     # the same VLM shape around a tiny random Llama: the wiring, in seconds

The chats mix image sizes and text lengths: easy-VQA's questions about a 64 x 64 picture (one-word answers),
chats about one of scikit-image's sample photographs at its own size (up to 1,411 x 1,411) with a CHAMP problem as
the question and its step-wise solution as the answer, and two-turn chats over two resized crops of the photographs
(sides of 32 to 900 pixels). Every step takes the same chats in both rows, from the same initial weights, with the
same optimizer (the Trainer's: `Trainer.get_optimizer_cls_and_kwargs`, constant lr, no weight decay) and gradient
clipping at 1.0. What each row's timer holds, per step:

- packed (lit_packing): each chat through `encode_image_chat` (what tokenizing the dataset does, once per run in
  training: timed here so that both rows start from the raw chats), `ImageChatCollator` (the images decoded and
  processed again, one flattened row, no padding), the SFT loss of the LightningModule's training step
  (`head_inputs` + `causal_lm_loss`: the chunked head, never the whole logits) of the model made packed by
  `pack_model(model, "per_example")`, over the step's label tokens; backward, clipping, the optimizer.
- padded (HF Trainer, its inner step): `ProcessorCollator`, the data collator a user hands `transformers.Trainer`
  (the processor on the rendered chats and their images, `padding=True`, labels on the assistant turns), then the
  body of the Trainer's loop for one optimizer step: `get_batch_samples` (`num_items_in_batch`), `training_step`
  (`compute_loss`: the unmodified model with sdpa and the attention mask, its own loss on the full logits;
  backward), `accelerator.clip_grad_norm_`, `optimizer.step`, `lr_scheduler.step`, `zero_grad`.

Effective tokens/s counts the chats' real tokens (text and image tokens, the same in both rows) over the timed steps
(after `--warmup`), by the clock and by the process's CPU time (all threads: on a machine shared with other work, the
clock of one step can vary several-fold, its CPU time far less); padding is the share of the row's slots that hold no
token. Peak host memory is the process's
peak resident set (VmHWM, reset at each step's start): both rows' weights and optimizer states live in this one
process, so the step's rise above its starting resident set is the row's own. Before the clock, both rows' inputs
are built for every step and checked to hold the same tokens and labels; each step's summed loss over those label
tokens agrees between the rows to fp32 rounding (the largest relative difference is printed). A default run (3
timed steps after 1 warm-up) takes ~6 CPU-minutes: ~3 minutes on 2 idle cores (10 on 2 cores shared with other
jobs); `--tiny` ~15 s.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from PIL import Image

from benchmarks.common import STATUS, peak_memory, reset_peak_memory
from lit_packing.batch import IGNORE_INDEX, IMAGES, INPUT_IDS, LABELS, STEP, attach_step
from lit_packing.errors import ConfigError

ROWS = {"packed": "packed (lit_packing)", "padded": "padded (HF Trainer step)"}
PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg", "hubble_deep_field.jpg", "motorcycle_left.png",
          "page.png", "text.png", "cell.png", "coins.png", "horse.png", "retina.jpg")  # fmt: skip
KINDS = ("vqa", "photo", "vqa", "crops")  # a step's chats take these in turn: short, long, short, long, ...
TINY_TEXT = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048, "tie_word_embeddings": True,
}  # fmt: skip


class Step(NamedTuple):
    """One training step of one row."""

    seconds: float  # the whole step: inputs, forward, backward, optimizer
    cpu_seconds: float  # the process's CPU time in it (all threads): steadier than the clock on a shared machine
    input_seconds: float  # of which building the inputs from the raw chats
    loss_sum: float  # the summed token loss over the step's label tokens
    label_tokens: int
    real_tokens: int
    slots: int  # the positions the model ran: the packed row's length, or rows x longest
    peak_gib: float  # the process's peak resident set during the step
    rise_gib: float  # that peak above the resident set at the step's start


class Ran(NamedTuple):
    """What a row's step hands the meter: its input seconds, the batch it trained and what the batch held."""

    input_seconds: float
    batch: dict
    loss_sum: float
    real_tokens: int


# ---------------------------------------------------------------- the chats


def photographs() -> dict[str, Image.Image]:
    """scikit-image's sample photographs (`PHOTOS`), RGB; its package is found, never imported (it imports slowly)."""
    spec = importlib.util.find_spec("skimage")
    if spec is None:
        fix = "pip install --no-deps scikit-image==0.26.0"
        raise ConfigError("skimage", "not installed: the photographs come from its wheel", fix)
    folder = Path(spec.submodule_search_locations[0]) / "data"
    return {name: Image.open(folder / name).convert("RGB") for name in PHOTOS}


def crop(photo: Image.Image, rng: random.Random) -> Image.Image:
    """A random box of `photo` resized to a random size: sides of 32 to 900 pixels, aspect up to 4:1 either way."""
    width, height = photo.size
    w, h = rng.randint(width // 4, width), rng.randint(height // 4, height)
    left, top = rng.randint(0, width - w), rng.randint(0, height - h)
    side, aspect = rng.randint(32, 900), 2 ** rng.uniform(-2, 2)
    size = (max(8, round(side * min(aspect, 1))), max(8, round(side / max(aspect, 1))))
    return photo.crop((left, top, left + w, top + h)).resize(size)


def turn(role: str, *parts: str | None) -> dict:
    """A turn of parts: a string is text, None an image."""
    return {"role": role, "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}


def image_chats(n: int, per_step: int, tokenizer, max_length: int, cache_dir: str, seed: int = 0) -> list[dict]:
    """`n` image chats (`messages`, `images` as RGB PIL images); each run of `per_step` takes the first `per_step`
    of `KINDS` in turn, shuffled (every step of two or more holds a short chat and a long one): an easy-VQA
    question, a photograph with a CHAMP problem and its solution, two crops over two turns. The CHAMP problems
    kept leave room for two images under `max_length`; the sources' tables are written under `cache_dir`."""
    from lit_packing.data import ChampProblems, EasyVQA

    rng = random.Random(seed)
    questions = EasyVQA(limit=400).load(cache_dir=cache_dir)
    room = max_length - 300  # the chat template, two images (<= 93 tokens each), a short turn
    problems = [p for p in ChampProblems().load(cache_dir=cache_dir)
                if len(tokenizer(p["prompt"] + p["completion"])[INPUT_IDS]) <= room]  # fmt: skip
    photos = photographs()
    kinds = []
    while len(kinds) < n:
        kinds += rng.sample([KINDS[k % len(KINDS)] for k in range(per_step)], per_step)
    chats = []
    for kind in kinds[:n]:
        if kind == "vqa":
            q = questions[rng.randrange(len(questions))]
            question = q["messages"][0]["content"][1]["text"]
            messages = [turn("user", None, question), turn("assistant", q["answer"])]
            chats.append({"messages": messages, "images": [q["images"][0].convert("RGB")]})
            continue
        problem = problems[rng.randrange(len(problems))]
        name = rng.choice(PHOTOS)
        if kind == "photo":
            chats.append({"messages": [turn("user", None, problem["prompt"]), turn("assistant", problem["completion"])],
                          "images": [photos[name]]})  # fmt: skip
            continue
        first, second = crop(photos[name], rng), crop(photos[rng.choice(PHOTOS)], rng)
        about = f"A part of the photograph {name.split('.')[0]}, shown at {first.width} x {first.height} pixels."
        messages = [turn("user", None, "What does this picture show?"), turn("assistant", about),
                    turn("user", None, problem["prompt"]), turn("assistant", problem["completion"])]  # fmt: skip
        chats.append({"messages": messages, "images": [first, second]})
    return chats


# ---------------------------------------------------------------- the padded row: what a Trainer user writes


class ProcessorCollator:
    """The data collator a user hands `transformers.Trainer` for image chats: the processor on the batch's chats
    (rendered by its chat template) and their images, padded to the longest; labels on the assistant turns only,
    each from after its `<|im_start|>assistant\\n` header up to and including its `<|im_end|>` (ChatML), the padding
    and every other token -100."""

    def __init__(self, processor) -> None:
        self.processor = processor
        tokenizer = processor.tokenizer
        self.header = torch.tensor(tokenizer("<|im_start|>assistant\n", add_special_tokens=False)[INPUT_IDS])
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, examples: list[dict]) -> dict:
        texts = [self.processor.apply_chat_template(ex["messages"], tokenize=False) for ex in examples]
        batch = self.processor(text=texts, images=[ex["images"] for ex in examples], padding=True, return_tensors="pt")
        batch[LABELS] = self.labels(batch[INPUT_IDS], batch["attention_mask"])
        return dict(batch)

    def labels(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """(B, T) labels: the ids inside each assistant turn, -100 elsewhere."""
        labels = torch.full_like(ids, IGNORE_INDEX)
        h = len(self.header)
        starts = (ids.unfold(1, h, 1) == self.header).all(-1) & mask[:, h - 1 :].bool()  # (B, T - h + 1)
        for row, at in starts.nonzero().tolist():
            begin = at + h
            ends = (ids[row, begin:] == self.end).nonzero()
            end = begin + int(ends[0]) + 1 if len(ends) else int(mask[row].sum())
            labels[row, begin:end] = ids[row, begin:end]
        return labels


def padded_trainer(start, processor, args: argparse.Namespace, out: str) -> Callable[[list[dict]], Step]:
    """A copy of `start` in a `transformers.Trainer` with `ProcessorCollator`; the step it returns runs the body of
    the Trainer's loop for one optimizer step (see the module docstring)."""
    from transformers import Trainer, TrainingArguments

    model = copy.deepcopy(start)
    settings = TrainingArguments(
        output_dir=out, use_cpu=True, learning_rate=args.lr,
        lr_scheduler_type="constant", max_grad_norm=1.0, weight_decay=0.0, report_to="none", save_strategy="no",
        per_device_train_batch_size=args.per_step, remove_unused_columns=False, disable_tqdm=True, seed=args.seed,
    )  # fmt: skip
    trainer = Trainer(model=model, args=settings, data_collator=ProcessorCollator(processor))
    trainer.create_optimizer_and_scheduler(num_training_steps=args.warmup + args.steps)

    def step(chats: list[dict]) -> Step:
        def run() -> Ran:
            begin = time.perf_counter()
            inputs = trainer.data_collator(chats)
            built = time.perf_counter() - begin
            (inputs,), items = trainer.get_batch_samples(iter([inputs]), 1, trainer.args.device)
            loss = trainer.training_step(model, inputs, items)
            trainer.accelerator.clip_grad_norm_(model.parameters(), settings.max_grad_norm)
            trainer.optimizer.step()
            trainer.lr_scheduler.step()
            model.zero_grad()
            return Ran(built, inputs, float(loss) * int(items), int(inputs["attention_mask"].sum()))

        return measured(run)

    return step


# ---------------------------------------------------------------- the packed row: lit_packing's path


def packed_trainer(start, folder: str, processor, args: argparse.Namespace, out: str) -> Callable[[list[dict]], Step]:
    """A packed copy of `start`; the step it returns encodes the chats, collates them into one row, runs the SFT
    loss over the step's label tokens, backward, clipping and the Trainer's optimizer (see the module docstring)."""
    from transformers import Trainer, TrainingArguments

    from lit_packing.data import ImageChatCollator
    from lit_packing.data.images import encode_image_chat
    from lit_packing.models.head import head_inputs
    from lit_packing.models.loss import causal_lm_loss
    from lit_packing.models.pack import pack_model

    model = copy.deepcopy(start)
    pack_model(model, backend="per_example")
    model.train()
    optimizer_class, options = Trainer.get_optimizer_cls_and_kwargs(
        TrainingArguments(output_dir=out, use_cpu=True, learning_rate=args.lr)
    )
    optimizer = optimizer_class([{"params": list(model.parameters()), "weight_decay": 0.0}], **options)
    collate = ImageChatCollator(pad_token_id=processor.tokenizer.pad_token_id)
    collate.connect_processor(folder)

    def step(chats: list[dict]) -> Step:
        def run() -> Ran:
            begin = time.perf_counter()
            encoded = [encode_image_chat(processor, chat, args.max_length, overlong="error") for chat in chats]
            (batch,) = attach_step([collate([{INPUT_IDS: e[INPUT_IDS], LABELS: e[LABELS], IMAGES: chat["images"]}
                                             for e, chat in zip(encoded, chats)])])  # fmt: skip
            built = time.perf_counter() - begin
            parts = causal_lm_loss(head_inputs(model, batch), batch)
            (parts.objective / batch[STEP]["label_tokens"]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            return Ran(built, batch, float(parts.token_loss_sum.detach()), sum(len(e[INPUT_IDS]) for e in encoded))

        return measured(run)

    return step


# ---------------------------------------------------------------- measuring


def resident_gib() -> float:
    """The process's resident set now (VmRSS, Linux; 0 elsewhere)."""
    if not Path(STATUS).exists():
        return 0.0
    line = next(x for x in Path(STATUS).read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 2**20  # kB


def measured(run: Callable[[], Ran]) -> Step:
    """One step of a row (`run`) under the clock, the CPU-time clock and the peak-memory meter."""
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = resident_gib()
    begin, cpu_begin = time.perf_counter(), time.process_time()
    ran = run()
    seconds, cpu_seconds = time.perf_counter() - begin, time.process_time() - cpu_begin
    peak = peak_memory(cpu)
    label_tokens = int((ran.batch[LABELS][..., 1:] != IGNORE_INDEX).sum())
    slots = ran.batch[INPUT_IDS].numel()
    return Step(seconds, cpu_seconds, ran.input_seconds, ran.loss_sum, label_tokens, ran.real_tokens, slots, peak,
                peak - before)  # fmt: skip


def check_same_tokens(processor, steps: list[list[dict]], max_length: int) -> None:
    """Both rows' inputs of every step hold the same tokens and labels: each padded row's real tokens are the
    encoded chat's ids and labels (its first label masked, as every packed document's is).

    Raises:
        ConfigError: a chat over `--max_length`.
        RuntimeError: naming the step and chat whose tokens or labels differ.
    """
    from lit_packing.data.images import encode_image_chat

    collate = ProcessorCollator(processor)
    for s, chats in enumerate(steps):
        batch = collate(chats)
        for k, chat in enumerate(chats):
            encoded = encode_image_chat(processor, chat, max_length, overlong="error")
            if not isinstance(encoded, dict):
                raise ConfigError("--max_length", f"step {s} chat {k}: {encoded}")
            n = int(batch["attention_mask"][k].sum())
            ids, labels = batch[INPUT_IDS][k, :n].tolist(), batch[LABELS][k, :n].tolist()
            labels[0] = IGNORE_INDEX
            for name, got, want in ((INPUT_IDS, ids, encoded[INPUT_IDS]), (LABELS, labels, encoded[LABELS])):
                if got != want:
                    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
                    raise RuntimeError(f"step {s} chat {k}: the padded batch's {name} differ from encode_image_chat's "
                                       f"from token {at:,} ({len(got):,} against {len(want):,} tokens)")  # fmt: skip


def run_rows(trainers: dict[str, Callable[[list[dict]], Step]], steps: list[list[dict]]) -> dict[str, list[Step]]:
    """Every row's steps, interleaved step by step (a drift of the machine's speed falls on both rows alike), the
    padded row first in even steps and second in odd ones."""
    runs: dict[str, list[Step]] = {name: [] for name in trainers}
    for s, chats in enumerate(steps):
        for name in list(trainers)[:: 1 if s % 2 else -1]:
            runs[name].append(trainers[name](chats))
    return runs


# ---------------------------------------------------------------- the report


def summarize(args, model: str, runs: dict[str, list[Step]]) -> dict:
    """Each row's effective tokens/s, padding, memory and input seconds over the timed steps; every step's losses."""
    rows = {}
    for name, steps in runs.items():
        timed = steps[args.warmup :]
        real, slots = sum(s.real_tokens for s in timed), sum(s.slots for s in timed)
        rows[name] = {
            "tokens_per_s": real / sum(s.seconds for s in timed),
            "tokens_per_cpu_s": real / sum(s.cpu_seconds for s in timed), "padding_ratio": 1 - real / slots,
            "real_tokens": real, "slots": slots, "peak_rss_gib": max(s.peak_gib for s in timed),
            "rise_gib": max(s.rise_gib for s in timed),
            "input_seconds_per_step": sum(s.input_seconds for s in timed) / len(timed),
            "seconds": [s.seconds for s in steps], "cpu_seconds": [s.cpu_seconds for s in steps],
            "step_real_tokens": [s.real_tokens for s in steps], "step_slots": [s.slots for s in steps],
            "loss_sums": [s.loss_sum for s in steps], "label_tokens": [s.label_tokens for s in steps],
        }  # fmt: skip
    packed, padded = runs["packed"], runs["padded"]
    spread = max(abs(a.loss_sum - b.loss_sum) / abs(b.loss_sum) for a, b in zip(packed, padded))
    timed = list(zip(packed, padded))[args.warmup :]
    for name in rows:
        rows[name]["vs_padded"] = rows[name]["tokens_per_s"] / rows["padded"]["tokens_per_s"]
        rows[name]["cpu_vs_padded"] = rows[name]["tokens_per_cpu_s"] / rows["padded"]["tokens_per_cpu_s"]
    return {
        "model": model, "tiny": args.tiny, "threads": torch.get_num_threads(), "per_step": args.per_step,
        "warmup": args.warmup, "timed_steps": args.steps, "max_length": args.max_length, "lr": args.lr,
        "padded_row": "transformers.Trainer inner step (get_batch_samples, training_step, clip_grad_norm_, "
                      "optimizer and scheduler step) on ProcessorCollator's batch",
        "same_labels": all(a.label_tokens == b.label_tokens for a, b in zip(packed, padded)),
        "loss_max_rel_diff": spread, "rows": rows,
        "step_ratios": [b.seconds / a.seconds for a, b in timed],  # padded / packed, each timed step: the noise
        "step_cpu_ratios": [b.cpu_seconds / a.cpu_seconds for a, b in timed],
    }  # fmt: skip


def print_report(report: dict, chats: list[dict]) -> None:
    """The run, what each timer holds, one line per row, every step's summed losses side by side, the JSON."""
    r = report
    sizes = sorted({image.size for chat in chats for image in chat["images"]}, key=lambda size: size[0] * size[1])
    smallest, largest = (" x ".join(map(str, size)) for size in (sizes[0], sizes[-1]))
    lines = [
        f"# {len(chats)} image chats, {r['per_step']} a step ({r['warmup']} warm-up + {r['timed_steps']} timed "
        f"steps), {len(sizes)} image sizes from {smallest} to {largest} px; {r['model']}, fp32, CPU, "
        f"{r['threads']} threads; the rows interleaved step by step",
        "# packed = encode_image_chat + ImageChatCollator (one row) + pack_model(per_example) + chunked-head SFT loss"
        " + backward + clip + AdamW",
        "# padded = ProcessorCollator (processor, padding=True, assistant labels) + transformers.Trainer's inner step"
        " (training_step: model loss on full logits with the attention mask; clip_grad_norm_; optimizer, scheduler)",
        f"{'variant':<26}{'tokens/s':>9}{'vs padded':>10}{'tokens/CPU-s':>13}{'vs padded':>10}{'padding':>8}"
        f"{'slots':>7}{'peak RSS':>10}{'rise':>9}{'inputs s':>9}",
    ]
    for name, label in ROWS.items():
        row = r["rows"][name]
        lines.append(
            f"{label:<26}{row['tokens_per_s']:>9.1f}{row['vs_padded']:>9.2f}x{row['tokens_per_cpu_s']:>13.1f}"
            f"{row['cpu_vs_padded']:>9.2f}x{row['padding_ratio']:>8.1%}{row['slots']:>7,}"
            f"{row['peak_rss_gib']:>6.2f} GiB{row['rise_gib']:>5.2f} GiB{row['input_seconds_per_step']:>9.2f}"
        )
    packed, padded = r["rows"]["packed"], r["rows"]["padded"]
    losses = zip(packed["loss_sums"], padded["loss_sums"], packed["label_tokens"])
    lines += [
        f"# effective tokens: the {packed['real_tokens']:,} text and image tokens of the timed steps; tokens/CPU-s: "
        "over the process's CPU time (all threads); peak RSS: the process's, both rows' weights and optimizer "
        "states in it; rise: the step's own above its start; inputs s: building a step's inputs, per step",
        "# summed loss per step, packed / padded (label tokens): "
        + ", ".join(f"{a:.4f} / {b:.4f} ({n:,})" for a, b, n in losses)
        + f"; max relative difference {r['loss_max_rel_diff']:.1e}",
        "# each timed step, padded / packed seconds: "
        + ", ".join(f"{a:.2f}x" for a in r["step_ratios"])
        + " by the clock, "
        + ", ".join(f"{a:.2f}x" for a in r["step_cpu_ratios"])
        + " by CPU time",
        json.dumps(report),
    ]
    print("\n".join(lines))


# ---------------------------------------------------------------- the run


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama inside the VLM (build_vlm)")
    parser.add_argument("--per_step", type=int, default=4, help="image chats a step (the padded batch's rows)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps")
    parser.add_argument("--max_length", type=int, default=1024, help="most tokens a chat may have")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.per_step < 1:
        parser.error("--steps and --per_step must be 1 or more, --warmup 0 or more")
    return args


def tiny_vlm(folder: Path) -> Path:
    """`build_vlm` over a tiny random Llama of SmolLM2's vocabulary (`TINY_TEXT`), saved with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lit_packing.assets import resolve_pretrained
    from lit_packing.models.vlm_assets import build_vlm

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_TEXT)).save_pretrained(folder / "text")
    AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False)).save_pretrained(folder / "text")
    return build_vlm(folder / "text", folder / "vlm")


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from lit_packing.assets import resolve_pretrained

    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="vlm_bench_") as scratch:
        folder = str(tiny_vlm(Path(scratch)) if args.tiny else resolve_pretrained("smolvlm-tiny"))
        processor = AutoProcessor.from_pretrained(folder)
        n = (args.warmup + args.steps) * args.per_step
        chats = image_chats(n, args.per_step, processor.tokenizer, args.max_length, scratch, args.seed)
        steps = [chats[i : i + args.per_step] for i in range(0, n, args.per_step)]
        check_same_tokens(processor, steps, args.max_length)
        start = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
        trainers = {"packed": packed_trainer(start, folder, processor, args, scratch),
                    "padded": padded_trainer(start, processor, args, scratch)}  # fmt: skip
        del start  # each row holds its own copy
        runs = run_rows(trainers, steps)
    model = "tiny VLM (build_vlm over a 2-layer, 64-wide Llama)" if args.tiny else "smolvlm-tiny"
    report = summarize(args, model, runs)
    print_report(report, chats)
    return report


if __name__ == "__main__":
    main()
