"""Load a pretrained checkpoint under FSDP2 on N CPU ranks, as a script, measuring each rank's anonymous memory;
for the slow tests of the meta-device build (tests/models/test_materialize.py).

    python tests/helpers/sharded_load.py '{"folder": "/tmp/m", "devices": 2, "out": "/tmp/load", "export": "/tmp/e"}'

Each rank writes `<out>.rank<r>.json`: its peak RssAnon above the interpreter's own (sampled every 2 ms) from the
model's construction to its end (the skeleton's packing probe: `build_peak`), from there to the end of its filling
(shard, fill: `load_peak`) and from the start to the end of setup (`fit` with `max_steps=0`: `setup_peak`),
what it holds then (`held`) and its peak during the export when asked; whether every local shard equals the
checkpoint's slice bit for bit (cast to fp32), whether the buffers equal those the model's own rotary module
computes, and whether a tied head is one storage. `"whole": true` builds the model whole on every rank first (no
`deferred_weights`), for comparison; `"model_config"` in place of `"folder"`: a random init; `"lora"`: adapters;
`"weights": true`: rank 0 also saves the initial (trainable, with a folder) weights whole to `<out>.weights.pt`.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

from lit_packing.models import PackedCausalLM, loading
from lit_packing.models.export import export_sharded
from lit_packing.models.materialize import checkpoint_names, deferred_weights, host_memory_returned
from lit_packing.processes import leave_process_group
from lit_packing.strategies import ShardedStrategy

SEED = 7  # the random init's (model_config, LoRA adapters), as a test building the same model in-process sets it


def rss_anon() -> int:
    """This process's anonymous resident memory, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class PeakSampler:
    """The highest `rss_anon()` seen since `reset`, sampled on a thread."""

    def __init__(self) -> None:
        self.peak = rss_anon()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.002)

    def reset(self) -> int:
        now = rss_anon()
        self.peak = now
        return now

    def stop(self) -> int:
        self._stop = True
        self._thread.join()
        return max(self.peak, rss_anon())


def slices_equal(lm: PackedCausalLM, folder: Path) -> bool:
    """Every parameter's local shard equal to its slice of the checkpoint's tensor (read whole, one at a time)."""
    files = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            files.update(dict.fromkeys(handle.keys(), file))
    for name, param in checkpoint_names(lm.model).items():
        with safe_open(str(files[name]), framework="pt") as handle:
            whole = handle.get_tensor(name).to(param.dtype)
        if isinstance(param, DTensor):
            expected = distribute_tensor(whole, param.device_mesh, param.placements, src_data_rank=None).to_local()
            local = param.to_local()
        else:
            expected, local = whole, param
        if not torch.equal(local.detach(), expected):
            return False
    return True


def buffers_equal(lm: PackedCausalLM) -> bool:
    """The rotary module's buffers equal those a fresh one computes from the config."""
    rotary = lm.hf_model.model.rotary_emb
    fresh = type(rotary)(lm.hf_model.config)
    return all(torch.equal(buffer, getattr(fresh, name)) for name, buffer in rotary.named_buffers(recurse=False))


def main(settings: dict) -> None:
    sampler = PeakSampler()
    base = sampler.reset()
    loaded: list[int] = []  # the peak from the end of construction to the end of filling
    materialize = loading.materialize

    def measured(*args, **kwargs):
        materialize(*args, **kwargs)
        loaded.append(sampler.peak - base)

    loading.materialize = measured
    folder = Path(settings["folder"]) if settings.get("folder") else None
    torch.manual_seed(SEED)
    source = {"name_or_path": str(folder)} if folder else {"model_config": settings["model_config"]}
    with deferred_weights() if not settings.get("whole") else torch.device("cpu"):
        lm = PackedCausalLM(**source, lora=settings.get("lora"), memory_check=False, isolation_check=False)
    build_peak = sampler.peak - base  # the skeleton's packing probe (built whole: the build itself)
    sampler.peak = rss_anon()
    tp = settings.get("tp", 1)
    strategy = ShardedStrategy(data_parallel_size=settings["devices"] // tp, tensor_parallel_size=tp)
    trainer = Trainer(accelerator="cpu", devices=settings["devices"], strategy=strategy, max_steps=0,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)  # fmt: skip
    trainer.fit(lm, train_dataloaders=[{}])
    setup_peak = max(build_peak, sampler.peak - base)
    out = {
        "build_peak": build_peak,
        "load_peak": loaded[-1] if loaded else build_peak,  # built whole: the build itself
        "setup_peak": setup_peak,
        "held": rss_anon() - base,
    }
    with host_memory_returned():  # the checks' scratch copies do not stay in the heap under the export's baseline
        out["slices_equal"] = slices_equal(lm, folder) if folder else None
        out["buffers_equal"] = buffers_equal(lm)
        out["tied"] = lm.hf_model.lm_head.weight is lm.hf_model.model.embed_tokens.weight
    if settings.get("weights"):  # a small model's initial weights, whole (a collective), for comparison
        names = [n for n, p in lm.model.named_parameters() if folder is None or p.requires_grad]
        whole = {n: p.full_tensor() if isinstance(p, DTensor) else p.detach() for n, p in lm.model.named_parameters()
                 if n in names}  # fmt: skip
        if trainer.global_rank == 0:
            torch.save(whole, f"{settings['out']}.weights.pt")
    if settings.get("export"):
        held = sampler.reset() - base
        export_sharded(lm.model, settings["export"], file_bytes=settings.get("file_bytes", 2**30))
        out["export_peak"] = sampler.peak - base
        out["held_before_export"] = held
    sampler.stop()
    Path(f"{settings['out']}.rank{trainer.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
    leave_process_group()  # as the command line does: a gloo group left to the exit can abort the rank
