"""How the toolkit words its numbers in messages and logs, so that every line reads the same.

count(1, "bad row")   # '1 bad row'          count(2_080, "example")   # '2,080 examples'
"""

from __future__ import annotations


def plural(n: int, word: str) -> str:
    """`word` for one, else its plural (`-s`, or `-es` after s/x/ch/sh): `plural(2, "batch")` -> `batches`.

    >>> plural(1, "pack"), plural(0, "pack"), plural(3, "batch")
    ('pack', 'packs', 'batches')
    """
    if n == 1:
        return word
    return f"{word}es" if word.endswith(("s", "x", "ch", "sh")) else f"{word}s"


def count(n: int, word: str) -> str:
    """`n` with thousands separators and `word` in the right number.

    >>> count(1, "optimizer step"), count(12_345, "example")
    ('1 optimizer step', '12,345 examples')
    """
    return f"{n:,} {plural(n, word)}"


def dividing_fix(packs: int, world: int, setting: str) -> str:
    """How to fix a global batch of `packs` that `world` ranks cannot split: the world sizes that can, or a global
    batch that can.

    >>> dividing_fix(6, 4, "data.packs_per_step")
    'run on a number of ranks that divides 6 (1, 2, 3, 6), or set data.packs_per_step to a multiple of 4 (e.g. 4 or 8)'
    """
    sizes = [d for d in range(1, packs + 1) if packs % d == 0]
    shown = ", ".join(map(str, sizes[:8])) + (", ..." if len(sizes) > 8 else "")
    low = world * max(packs // world, 1)
    return (
        f"run on a number of ranks that divides {packs} ({shown}), or set {setting} to a multiple of {world} "
        f"(e.g. {low} or {low + world})"
    )
