"""Steps the ranks take together, with one of 2 gloo ranks failing at each, as a script.

    python tests/helpers/agree_ranks.py '{"out": "/tmp/agree.json"}'

The script starts 2 ranks (processes of its own, each with its own environment), which run, one after another:
- `selftest`: the isolation self-test of a model sharded with FSDP2, judged on rank 1 with a tolerance nothing
  meets (`rtol=-1`): rank 1's search for the leaking module runs FSDP2 forwards, which rank 0 must run too;
- `export`: the sharded export into a path that is a file on rank 0 (it cannot make the folder) while rank 1
  sends it its rows;
- `loading`: the weights of a Hub id read with the Hub off (`HF_HUB_OFFLINE=1`) from each rank's own Hugging Face
  cache: rank 0's holds the model, rank 1's its config alone (a download that failed part-way): rank 1 fails
  before `dcp.load`, which rank 0 enters.
Each case is bounded by the process group's 60-second timeout. Rank 0 writes, per case, what each rank raised
(`type: message`) and the seconds it took.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HUB_ID = "lit-packing-tests/tiny-llama"
COMMIT = "0" * 40


def hub_cache(folder: Path, weights: bool) -> Path:
    """A Hugging Face cache holding `HUB_ID`'s snapshot (a tiny Llama's config, and its safetensors if `weights`),
    as huggingface_hub lays one out: refs/main naming the commit, snapshots/<commit>/ the files."""
    from tests.helpers import TINY_LLAMA, tiny_model

    repo = folder / ("models--" + HUB_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    tiny_model(TINY_LLAMA).save_pretrained(snapshot)
    if not weights:
        for file in snapshot.glob("*.safetensors"):
            file.unlink()
    return folder


def run_case(name: str, step) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        step()
        outcome = ""
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    return outcome, time.perf_counter() - start


def rank_main(settings: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lit_packing.data.collate import PackedCollator
    from lit_packing.models.export import export_sharded
    from lit_packing.models.loading import fill_models, model_skeleton
    from lit_packing.models.pack import pack_model
    from lit_packing.models.selftest import check_isolation
    from tests.helpers import TINY_LLAMA, make_examples, tiny_model

    rank = settings["rank"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{settings['store']}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))  # fmt: skip

    def sharded():
        model = tiny_model(TINY_LLAMA)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model

    def selftest():
        model = sharded()
        pack_model(model, "per_example")
        batch = PackedCollator()(make_examples([5, 9, 3], vocab=300, seed=rank))
        check_isolation(model, batch, "per_example", rtol=-1.0 if rank == 1 else None, group=dist.group.WORLD)

    def export():
        target = Path(settings["folder"]) / "export"
        if rank == 0:
            target.write_text("a file where the folder should go")
        export_sharded(sharded(), str(target))

    def loading():
        hp = {"model_config": None, "name_or_path": HUB_ID, "attn_backend": "per_example", "mixers": "refuse",
              "isolation_check": False, "loss_impl": "chunked"}  # fmt: skip
        skeleton = model_skeleton(HUB_ID, None, None, None, False)
        strategy = type("OneDevice", (), {"root_device": torch.device("cpu"), "broadcast": staticmethod(lambda x: x)})
        fill_models(hp, [skeleton], strategy, seed=0)

    results = {}
    for name, step in (("selftest", selftest), ("export", export), ("loading", loading)):
        outcome, seconds = run_case(name, step)
        everyone: list = [None, None]
        dist.all_gather_object(everyone, outcome)
        results[name] = {"raised": everyone, "seconds": seconds}
    if rank == 0:
        Path(settings["out"]).write_text(json.dumps(results))
    dist.barrier()  # neither rank tears the group down while the other still uses it
    dist.destroy_process_group()
    # Then out at once: once (of many runs, with the cores busy) rank 0 aborted in the interpreter's teardown after
    # both ranks had passed the barrier above ("terminate called without an active exception": gloo's threads
    # released during finalization), which is not what this script tests.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(settings: dict) -> None:
    with tempfile.TemporaryDirectory() as folder:
        caches = [hub_cache(Path(folder) / f"hub{rank}", weights=rank == 0) for rank in range(2)]
        ranks = []
        for rank in range(2):
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(caches[rank]), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(ROOT)}  # fmt: skip
            args = {"rank": rank, "store": f"{folder}/store", "folder": folder, "out": settings["out"]}
            ranks.append(subprocess.Popen([sys.executable, __file__, json.dumps(args)], env=env, cwd=ROOT))
        codes = [rank.wait(timeout=600) for rank in ranks]
        if any(codes):
            raise SystemExit(f"ranks exited with {codes}")


if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    if "rank" in given:
        sys.path.insert(0, str(ROOT))
        rank_main(given)
    else:
        sys.path.insert(0, str(ROOT))
        main(given)
