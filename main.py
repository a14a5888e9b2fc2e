"""Entry point: `python main.py fit --config configs/quickstart.yaml`."""

from lit_packing.cli import cli_main

if __name__ == "__main__":
    cli_main()
