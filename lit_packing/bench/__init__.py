"""The benchmark: the paper's table end to end, our variants beside the tools users run today.

    python -m lit_packing.bench                          # CPU: SmolLM2-135M's architecture with 4 layers, 3 rounds
    python -m lit_packing.bench --smoke                  # the same wiring with a tiny model, in a minute or two
    python -m lit_packing.bench --config bench.yaml --rounds 5 --variants '[padding, minibatch_packing]'

`run.py` plans and interleaves the runs, `worker.py` trains one (ours through the CLI's own path, the Hugging Face
Trainer and TRL's SFTTrainer through theirs), `report.py` turns the runs into the table, the targets and the plot.
"""
