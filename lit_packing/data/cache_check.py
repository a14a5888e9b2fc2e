"""The tokenized cache's check: a size + XXH3-128 record beside the Arrow files `datasets.map` writes.

    verify_cache(folder, fingerprint)   # deletes damaged or unrecorded cache files, so the map rebuilds them

`tokenize_dataset` removes killed runs' temporary files, verifies the cache before its map and records it after.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

STALE_TMP_SECONDS = 600  # a `tmp*` file untouched this long in a cache folder is a killed run's leftover


def file_record(path: Path) -> list:
    """[size, XXH3-128 hex] of a file, streamed in 8 MiB blocks. XXH3 (xxhash, a `datasets` dependency) catches
    any accidental damage and reads GB/s, so checking a 160 MiB cache costs tens of milliseconds."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as file:
        while block := file.read(8 << 20):
            digest.update(block)
    return [path.stat().st_size, digest.hexdigest()]


def cache_files(folder: Path, fingerprint: str) -> list[Path]:
    """The Arrow files of one tokenization (its `fingerprint`) in a `datasets` cache folder."""
    return sorted(folder.glob(f"cache-{fingerprint}*.arrow"))


def checksum_path(folder: Path, fingerprint: str) -> Path:
    return folder / f"cache-{fingerprint}.check.json"


def remove_stale_tmp(folder: Path) -> None:
    """Delete `tmp*` files that killed runs left in a cache folder (untouched for `STALE_TMP_SECONDS`)."""
    now, removed = time.time(), []
    for path in folder.glob("tmp*"):
        if path.is_file() and now - path.stat().st_mtime > STALE_TMP_SECONDS:
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        log.warning("removed %d temporary file(s) left by killed runs in %s: %s", len(removed), folder, removed)


def verify_cache(folder: Path, fingerprint: str) -> None:
    """Delete this tokenization's cache files when they differ from their record, or have none (an older version
    wrote them, or a run died before recording them), so the map rebuilds them; say so."""
    files, record_path = cache_files(folder, fingerprint), checksum_path(folder, fingerprint)
    if not files:
        return
    try:
        expected = json.loads(record_path.read_text())
    except (OSError, ValueError):
        expected = None
    if expected is not None and {path.name: file_record(path) for path in files} == expected:
        return
    problem = "has no size + checksum record" if expected is None else "does not match its size + checksum record"
    log.warning("the tokenized cache %s %s (%s): rebuilding it", [str(p) for p in files], problem, record_path)
    for path in [*files, record_path]:
        path.unlink(missing_ok=True)


def write_record(folder: Path, fingerprint: str) -> None:
    """Record size + checksum of this tokenization's cache files, atomically (a temporary file, then a rename)."""
    record_path, files = checksum_path(folder, fingerprint), cache_files(folder, fingerprint)
    if record_path.exists() or not files:
        return
    record = {path.name: file_record(path) for path in files}
    with tempfile.NamedTemporaryFile("w", dir=folder, prefix="tmp", suffix=".json", delete=False) as tmp:
        json.dump(record, tmp)
    os.replace(tmp.name, record_path)
