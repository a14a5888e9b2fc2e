"""Bad settings stop at instantiation, before tokenization or model loading, naming the full CLI path."""

from __future__ import annotations

import copy
import functools
import logging
import math

import datasets
import pytest
import torch

from lit_packing.cli import cli_main
from lit_packing.data import PackingDataModule
from lit_packing.data.tokenize import tokenize_dataset
from lit_packing.errors import ConfigError
from lit_packing.models import PackedCausalLM
from lit_packing.samplers import BestFitPackingSampler, RandomBatchSampler

# A model name that cannot load: reaching the loader would raise something else than the ConfigError expected.
UNLOADABLE = "no/such-model-anywhere"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_length": 1}, "data.max_length: must be >= 2 to hold a trained token, got 1"),
        ({"limit": 0}, "data.limit: must be >= 1, got 0"),
        ({"seed": -1}, "data.seed: must be >= 0, got -1"),
        ({"num_workers": -1}, "data.num_workers: must be >= 0, got -1"),
        ({"num_proc": 0}, "data.num_proc: must be >= 1, got 0"),
        ({"val_split": 1.0}, "data.val_split: must be < 1, got 1.0"),
        ({"val_split": -0.5}, "data.val_split: must be >= 0, got -0.5"),
        ({"val_split": -3}, "data.val_split: must be >= 0, got -3"),
        ({"val_split": math.nan}, "data.val_split: must be a finite number, got nan"),
        (
            {"sampler": functools.partial(BestFitPackingSampler, max_tokens=0)},
            "data.sampler.init_args.max_tokens: must be >= 1, got 0",
        ),
        (
            {"val_sampler": functools.partial(RandomBatchSampler, batch_size=0)},
            "data.val_sampler.init_args.batch_size:",
        ),
    ],
)
def test_data_settings_are_range_checked_at_construction(kwargs, message):
    with pytest.raises(ConfigError) as error:
        PackingDataModule(tokenizer=UNLOADABLE, **kwargs)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"lr": -1e-4}, "model.lr: must be >= 0, got -0.0001"),
        ({"lr": math.inf}, "model.lr: must be a finite number, got inf"),
        ({"weight_decay": -0.1}, "model.weight_decay: must be >= 0, got -0.1"),
        ({"eps": 0.0}, "model.eps: must be > 0, got 0.0"),
        ({"warmup_steps": -1}, "model.warmup_steps: must be >= 0, got -1"),
        ({"min_lr_ratio": 1.5}, "model.min_lr_ratio: must be <= 1, got 1.5"),
        ({"betas": (0.9, 1.0)}, "model.betas[1]: must be < 1, got 1.0"),
        ({"vocab_size": 0}, "model.vocab_size: must be >= 1, got 0"),
        ({"nonfinite": "ignore"}, "model.nonfinite: 'ignore' is not a policy; use error or skip"),
        ({"attn_backend": "flash_attn"}, "model.attn_backend: flash_attn needs"),
        ({"attn_backend": "torch_varlen"}, "model.attn_backend: torch_varlen needs"),
    ],
)
def test_model_settings_are_checked_before_the_model_loads(kwargs, message):
    if "attn_backend" in kwargs and torch.cuda.is_available():
        pytest.skip("a CUDA machine may run this backend")
    with pytest.raises(ConfigError) as error:
        PackedCausalLM(name_or_path=UNLOADABLE, **kwargs)
    assert str(error.value).startswith(message)
    if "attn_backend" in kwargs:
        assert str(error.value).endswith("on cpu these run: auto, per_example, sdpa_mask")


def test_cli_stops_before_tokenizing_and_exits_2(tmp_path, capsys):
    cache = tmp_path / "cache"
    with pytest.raises(SystemExit) as exit_:
        cli_main(
            ["fit", "--data.sampler.init_args.max_tokens=0", f"--data.cache_dir={cache}", "--trainer.logger=false"]
        )
    assert exit_.value.code == 2
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        "error: data.sampler.init_args.max_tokens: must be >= 1, got 0"
    )
    assert not cache.exists()  # nothing was loaded or tokenized


def test_a_linked_value_that_overwrites_the_users_says_so(tiny_llama_config, caplog):
    with caplog.at_level(logging.WARNING, logger="lit_packing.models.loading"):
        lm = PackedCausalLM(model_config={**tiny_llama_config, "vocab_size": 100}, vocab_size=49_152)
    assert lm.hf_model.config.vocab_size == 49_152
    assert "model.model_config.vocab_size=100 is replaced by the tokenizer's size 49152" in caplog.text


def test_a_model_that_cannot_isolate_packed_examples_names_the_setting():
    bloom = dict(model_type="bloom", vocab_size=1000, hidden_size=64, n_layer=2, n_head=4)
    with pytest.raises(ConfigError, match=r"^model.name_or_path: BloomForCausalLM \(bloom\) does not route attention"):
        PackedCausalLM(model_config=bloom)


def test_tokenizer_without_eos_for_text_names_the_setting(gpt2_tokenizer):
    no_eos = copy.deepcopy(gpt2_tokenizer)
    no_eos.eos_token = None
    with pytest.raises(ConfigError, match=r"^data.tokenizer: .* has no eos_token to end text examples with"):
        tokenize_dataset(datasets.Dataset.from_list([{"text": "hello"}]), no_eos)


def test_tokenizer_without_pad_pads_with_eos():
    assert PackingDataModule(tokenizer="gpt2-tokenizer").pad_token_id == 50_256  # GPT-2 has no pad token


def test_token_ids_outside_the_embeddings_are_refused_before_the_first_step(tmp_path, tiny_llama_config):
    from lightning.pytorch import Trainer

    from lit_packing.data import Chatterbot
    from lit_packing.errors import DataError

    lm = PackedCausalLM(model_config={**tiny_llama_config, "vocab_size": 1_000})
    dm = PackingDataModule(source=Chatterbot(), limit=20, val_split=0, cache_dir=str(tmp_path))
    trainer = Trainer(fast_dev_run=1, accelerator="cpu", logger=False, enable_progress_bar=False)
    with pytest.raises(DataError, match=r"token ids \d+\.\.\d+,\d+ but the model has 1,000 embedding rows"):
        trainer.fit(lm, datamodule=dm)
    assert trainer.global_step == 0
