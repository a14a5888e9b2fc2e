"""Entry point of the repository: `python main.py fit --config configs/quickstart.yaml` (or `--config quickstart`).

The same command as the installed `lit-packing` (`lit_packing.commands`): `fit`/`validate`/`test`, `export`,
`report` and `configs`.
"""

from lit_packing.commands import main

if __name__ == "__main__":
    main()
