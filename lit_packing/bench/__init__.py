"""The benchmark: the paper's table end to end, our variants beside the tools users run today.

    python -m lit_packing.bench                          # CPU: SmolLM2-135M's architecture with 4 layers, 3 rounds
    python -m lit_packing.bench --smoke                  # the same wiring with a tiny model, in a few minutes
    python -m lit_packing.bench --config bench.yaml --rounds 5 --variants '[padding, minibatch_packing]'

`run.py` plans and interleaves the runs, `worker.py` trains one (ours through the CLI's own path on the variant's
packaged config), `peers.py` the Hugging Face Trainer's and TRL's SFTTrainer's rows through theirs (TRL comes with
the `bench` extra: `pip install "lit_packing[bench]"`), `report.py` turns the runs into the table, the targets and
the plot. The focused measurements live here too, each `python -m lit_packing.bench.<name> --help` (and
`python benchmarks/<name>.py`): `loss_parity`, `loss_memory`, `attention_throughput`, `compile_speed`,
`packing_speed`, `cache_check`, `plot_metrics`.
"""
