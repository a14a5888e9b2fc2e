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
