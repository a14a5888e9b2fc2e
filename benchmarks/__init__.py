"""The benchmark: the paper's table end to end, our variants beside the tools users run today. It runs from a
checkout of the repository (it is not part of the installed package), from the repository root:

    python -m benchmarks                 # CPU: SmolLM2-135M's architecture with 4 layers, 3 rounds
    python -m benchmarks --smoke         # the same wiring with a tiny model, in a few minutes
    python -m benchmarks --config bench.yaml --rounds 5 --variants '[padding, minibatch_packing]'

`run.py` plans and interleaves the runs, `worker.py` trains one (ours through the CLI's own path on the variant's
packaged config), `peers.py` the Hugging Face Trainer's and TRL's SFTTrainer's rows through theirs (TRL comes with
the `bench` extra: `pip install -e ".[bench]"` in the checkout), `report.py` turns the runs into the table, the
targets and the plot; `common.py` holds what they share (starting a benchmark module in a child process, the step
clock, peak memory), so that no two benchmark modules import each other. The focused measurements live here too, each
`python -m benchmarks.<name> --help`: `loss_parity`, `loss_memory`, `auto_budget`, `attention_throughput`,
`compile_speed`, `packing_speed`, `stream_fill`, `stream_pipeline`, `cache_check`, `plot_metrics`, `grpo_throughput`
(the GRPO step against TRL's `GRPOTrainer`, like for like), `vlm` (packed image chats against the Hugging Face
Trainer's padded batch of the same chats).
"""
