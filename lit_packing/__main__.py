"""`python -m lit_packing ...`, e.g. `python -m lit_packing fit --config quickstart`: the `lit-packing` command.

See `lit_packing.commands`.
"""

from lit_packing.commands import main

if __name__ == "__main__":  # not when pytest imports this module for its doctests
    main()
