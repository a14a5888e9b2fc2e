"""lit_packing: packed (padding-free) fine-tuning of Hugging Face causal LMs with PyTorch Lightning.

    python main.py fit --config configs/quickstart.yaml

Data flows sources -> tokenize -> sampler -> collate -> model -> callbacks: see `lit_packing.data`,
`lit_packing.samplers`, `lit_packing.models`, `lit_packing.callbacks` and the `LightningCLI` in `lit_packing.cli`.
"""

__version__ = "0.1.0"
