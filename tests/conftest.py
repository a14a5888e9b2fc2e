"""Shared fixtures: the real SmolLM2 tokenizer (offline, packaged) and tiny random models of real architectures."""

from __future__ import annotations

import contextlib
import gc
import os

# One intra-op thread per test process (and the subprocesses it starts: CLI runs, DDP ranks), unless set: the models
# here are tiny, and when the cores are busy (another process, or the ranks a test starts) OpenMP's spinning threads
# make a test 5-10x slower.
ONE_THREAD = "OMP_NUM_THREADS" not in os.environ
if ONE_THREAD:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if ONE_THREAD:
    torch.set_num_threads(1)  # in case torch was imported before this file


@contextlib.contextmanager
def all_cores():
    """Every core for what runs inside: this process's intra-op threads and the subprocesses it starts. For the slow
    tier's runs of one process at a time (in-process fits, the benchmark's workers), where one thread leaves the
    other cores idle; a no-op under pytest-xdist (a worker per core) or where the user set OMP_NUM_THREADS. Only for
    what compares no bits with a run made on one thread."""
    if not ONE_THREAD or os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    cores = str(len(os.sched_getaffinity(0)))
    before = torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = cores
    torch.set_num_threads(int(cores))
    try:
        yield
    finally:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(before)


@pytest.fixture
def every_core():
    """`all_cores` for one test."""
    with all_cores():
        yield


# Each pytest-xdist worker compiles into a cache of its own: two workers compiling at once never share files.
if os.environ.get("PYTEST_XDIST_WORKER"):
    import tempfile

    WORKER_CACHE = os.path.join(tempfile.gettempdir(), f"torchinductor_{os.environ['PYTEST_XDIST_WORKER']}")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", WORKER_CACHE)

# Tests never reach the network: the packaged assets are all they need.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# What a launcher (or Lightning's DDP in-process) leaves in the environment; a later subprocess would inherit it.
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE",
                   "LIT_PACKING_LAUNCHER_PID")  # fmt: skip


@pytest.fixture(autouse=True)
def no_frozen_heap():
    """The command line run in-process (`lit_packing.commands.main`) freezes every object then alive out of the
    garbage collector, as a command's process should; the test's process gets them back after the test."""
    yield
    if gc.get_freeze_count():
        gc.unfreeze()


@pytest.fixture(autouse=True)
def no_leaked_process_group():
    """A config run in-process with `strategy: ddp` opens a process group and sets MASTER_PORT; close both after the
    test so that later launches do not find the port taken."""
    saved = {key: os.environ.get(key) for key in DISTRIBUTED_ENV}
    yield
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def pytest_collection_modifyitems(config, items):
    # `serial` tests run in `make test-slow`'s second pass, two at a time; one not also `slow` would run in `make test`
    # beside every other fast test (pytest-xdist), where what makes it serial (killed processes, memory peaks) is not
    # safe.
    unsafe = [item.nodeid for item in items if "serial" in item.keywords and "slow" not in item.keywords]
    if unsafe:
        raise pytest.UsageError(f"marked serial but not slow: {', '.join(unsafe)}")
    skip_cuda = pytest.mark.skip(reason="needs an NVIDIA GPU (cuda marker)")
    if not torch.cuda.is_available():
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip_cuda)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2-135M-Instruct tokenizer (ChatML template, eos = pad = <|im_end|> = 2)."""
    from transformers import AutoTokenizer

    from lit_packing.assets import resolve_pretrained

    return AutoTokenizer.from_pretrained(resolve_pretrained("smollm2", with_model=False))


@pytest.fixture(scope="session")
def gpt2_tokenizer():
    """The real GPT-2 BPE tokenizer (no chat template)."""
    from transformers import AutoTokenizer

    from lit_packing.assets import resolve_pretrained

    return AutoTokenizer.from_pretrained(resolve_pretrained("gpt2-tokenizer"))


# Tiny random configs of real architectures: SmolLM2's family (Llama) and two others.
# SmolLM2's architecture (Llama, its vocabulary and tokenizer) at a toy size: what CLI-level tests train, in seconds.
TINY = {
    "model_type": "llama", "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 8192, "tie_word_embeddings": True,
}  # fmt: skip
TINY_CONFIGS = {
    "llama": dict(
        model_type="llama",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    ),
    "gpt_neox": dict(
        model_type="gpt_neox",
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=2048,
        rotary_pct=0.5,
    ),
}


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny_config(request) -> dict:
    """A tiny random-init config (2 layers, hidden 64) for each supported family."""
    return dict(TINY_CONFIGS[request.param])


@pytest.fixture
def tiny_llama_config() -> dict:
    return dict(TINY_CONFIGS["llama"])


@pytest.fixture
def encoder_calls(monkeypatch):
    """Counts the batches the tokenizer really encodes (zero when the tokenization cache is used): `.calls`."""
    from lit_packing.data import encode

    class Calls:
        calls = 0

    counter = Calls()
    original = encode.Encoder.__call__

    def counted(encoder, batch, indices):
        counter.calls += 1
        return original(encoder, batch, indices)

    monkeypatch.setattr(encode.Encoder, "__call__", counted)
    return counter
