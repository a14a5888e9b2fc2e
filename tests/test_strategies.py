"""The process group's timeout: the toolkit's strategies (`ddp`, `configs/multinode.yaml`, FSDP2) give up on a rank
that stopped answering after 10 minutes, or what `trainer.strategy.init_args.timeout` says (seconds or h:m:s), and
hand it to Lightning, which hands it to `init_process_group`; a single-process run is left as it was. What a rank
does when a collective fails for a lost peer is tests/cli/test_lost_rank.py."""

from __future__ import annotations

import json
import math
from datetime import timedelta

import pytest
from lightning.pytorch.strategies import SingleDeviceStrategy

from lit_packing.cli import cli_main
from lit_packing.errors import ConfigError
from lit_packing.strategies import (
    PROCESS_GROUP_TIMEOUT,
    TIMEOUT_SETTING,
    DDPStrategy,
    ShardedStrategy,
    process_group_timeout,
)
from tests.conftest import TINY

DDP = f"{DDPStrategy.__module__}.{DDPStrategy.__name__}"


def test_the_default_is_ten_minutes_and_a_timeout_reads_as_seconds_or_a_timedelta():
    assert timedelta(minutes=10) == PROCESS_GROUP_TIMEOUT
    assert process_group_timeout(90) == process_group_timeout(90.0) == timedelta(seconds=90)
    assert process_group_timeout(timedelta(minutes=5)) == timedelta(seconds=300)
    for bad in (0, -1, math.nan, math.inf, True, timedelta(0)):
        with pytest.raises(ConfigError, match=rf"^{TIMEOUT_SETTING}: .* is not a positive duration; give seconds"):
            process_group_timeout(bad)


def built(tmp_path, *extra: str):
    """The CLI's trainer for a tiny fit on the CPU, built and not run."""
    tiny = [f"--model.model_config={json.dumps(TINY)}", "--trainer.accelerator=cpu", "--trainer.devices=1"]
    here = ["--trainer.logger=false", f"--trainer.default_root_dir={tmp_path}"]
    return cli_main(["--config", "quickstart", *tiny, *here, *extra], run=False).trainer


@pytest.mark.parametrize(
    "given, kind, seconds",
    [
        (["--trainer.strategy=ddp"], DDPStrategy, 600),
        (["--trainer.strategy=DDPStrategy"], DDPStrategy, 600),
        ([f"--trainer.strategy={DDP}", "--trainer.strategy.init_args.timeout=45"], DDPStrategy, 45),
        (["--trainer.strategy=lightning.pytorch.strategies.DDPStrategy",
          "--trainer.strategy.init_args.timeout=0:02:00"], DDPStrategy, 120),
        (["--trainer.strategy=ModelParallelStrategy"], ShardedStrategy, 600),
        (["--config", "gpu", "--config", "multinode", "--trainer.accelerator=cpu", "--trainer.precision=32-true",
          "--trainer.devices=1", "--trainer.strategy.init_args.timeout=20"], DDPStrategy, 20),
    ],
    ids=["ddp", "class-name", "seconds", "lightning-class-h:m:s", "fsdp2", "multinode.yaml"],
)  # fmt: skip
def test_the_toolkits_strategies_hand_their_timeout_to_lightning(given, kind, seconds, tmp_path):
    strategy = built(tmp_path, *given).strategy
    assert type(strategy) is kind and strategy.timeout == timedelta(seconds=seconds)
    assert strategy._timeout == strategy.timeout  # what Lightning passes to init_process_group; checked on 2.6.6


def test_a_single_process_run_keeps_lightnings_own_strategy(tmp_path):
    assert type(built(tmp_path).strategy) is SingleDeviceStrategy


def test_a_timeout_that_is_no_duration_is_refused_naming_the_setting(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        built(tmp_path, f"--trainer.strategy={DDP}", "--trainer.strategy.init_args.timeout=0")
    assert exit_info.value.code == 2
    assert f"error: {TIMEOUT_SETTING}: 0.0 is not a positive duration" in capsys.readouterr().out
