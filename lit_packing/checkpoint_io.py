"""AtomicCheckpointIO: every checkpoint is written in its own folder, flushed to disk, then renamed over the one
before: a kill at any moment leaves the previous checkpoint or the new one, never a partial file under its name.

    Trainer(plugins=[AtomicCheckpointIO()])   # the CLI's default; `trainer.plugins` in YAML chooses another

Lightning's `TorchCheckpointIO` first serialises the whole checkpoint into memory (a second copy of every tensor),
then writes it through an fsspec transaction, which stages the file in full in `TMPDIR` and moves it into place.
Where `TMPDIR` is another filesystem than the checkpoint folder (a node-local or RAM-backed `/tmp` beside a shared
folder) the move is a copy: a kill during it left `last.ckpt` at 0 bytes and the staged file in `TMPDIR`, and the
save needed free room for a whole checkpoint there. Here `torch.save` streams into an unnamed file of the
checkpoint's folder (Linux `O_TMPFILE`: a kill during the write leaves nothing to clean up), which gets a hidden
name (`.last.ckpt.partial`) only once flushed and `fsync`ed, and is renamed over `last.ckpt` at once (one
`rename`, atomic on a POSIX filesystem). Where `O_TMPFILE` is not supported (NFS, some parallel filesystems) the
hidden name is written directly; a killed save leaves it, and the next save of that checkpoint removes it.

A distributed checkpoint (a folder of shards, `strategies.ShardedStrategy`) is written whole under the hidden name
by every rank, then takes the checkpoint's name by renames (`replace_folder`): Lightning's own writer rewrites the
folder in place, so a save killed part-way left new shards beside the previous `meta.pt`, a checkpoint that reads
as complete and holds two steps' weights.

A full disk (`ENOSPC`, or a quota) is named before writing, from the checkpoint's tensor bytes and the folder's
free space, or when the write fails: `CheckpointSpaceError`, one line with the folder and the space needed, the
previous checkpoint untouched. Paths of other filesystems (`s3://...`) go through Lightning's writer unchanged.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from lit_packing.errors import LitPackingError

PARTIAL_SUFFIX = ".partial"  # `.last.ckpt.partial`: neither Lightning nor `--ckpt_path=last` takes it for a checkpoint
FULL_DISK = (errno.ENOSPC, errno.EDQUOT)


class CheckpointSpaceError(LitPackingError, OSError):
    """A checkpoint did not fit where it is written; the previous one is intact (printed alone by the CLI)."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's `TorchCheckpointIO` (the same loading) whose local saves are atomic, stream to disk and stage
    nothing in `TMPDIR`: see the module's docstring."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if not is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options for a local path, got {storage_options}")
        write_atomically(checkpoint, Path(path), self.open_partial)

    def open_partial(self, folder: Path, partial: Path) -> tuple[IO[bytes], bool]:
        """The file to stream a checkpoint into, in `folder`, and whether it is unnamed (`O_TMPFILE`, linked as
        `partial` once complete) or `partial` itself. A subclass may write elsewhere (tests: a failing disk)."""
        return open_partial(folder, partial)


def is_local(path: Any) -> bool:
    """Whether `path` is on this machine's filesystem (not `s3://...` or another fsspec filesystem)."""
    return isinstance(get_filesystem(str(path)), LocalFileSystem)


def open_partial(folder: Path, partial: Path) -> tuple[IO[bytes], bool]:
    """`AtomicCheckpointIO.open_partial`: an unnamed file of `folder` where Linux has them, else `partial`."""
    if hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
        try:
            return os.fdopen(os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o666), "wb"), True
        except OSError as error:
            if error.errno in FULL_DISK:
                raise
    return open(partial, "wb"), False


def write_atomically(checkpoint: dict[str, Any], path: Path, open_partial=open_partial) -> None:
    """`torch.save(checkpoint, path)` such that `path` is at every moment the previous file or the complete new one.

    Args:
        checkpoint: what Lightning's `dump_checkpoint` made.
        path: the checkpoint's final name; its folder is created if needed.
        open_partial: `(folder, partial) -> (file, unnamed)`, as `AtomicCheckpointIO.open_partial`.

    Raises:
        CheckpointSpaceError: the folder has no room for it (checked before writing, and on `ENOSPC`).
    """
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    partial = hidden(path, PARTIAL_SUFFIX)
    partial.unlink(missing_ok=True)  # what a killed save left where O_TMPFILE is not supported
    needed = tensor_bytes(checkpoint)
    if shutil.disk_usage(folder).free < needed:
        raise CheckpointSpaceError(no_room(path, needed))
    try:
        file, unnamed = open_partial(folder, partial)
        with file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
            if unnamed:
                _link(file, partial)
        os.replace(partial, path)
    except BaseException as error:
        partial.unlink(missing_ok=True)
        if _full_disk(error):
            raise CheckpointSpaceError(no_room(path, needed)) from None
        raise
    _fsync_folder(folder)  # the rename itself survives a power cut


OLD_SUFFIX = ".old"  # `.last.ckpt.old`: a distributed checkpoint's previous folder while the new one takes its name


def hidden(path: Path, suffix: str) -> Path:
    """`checkpoints/.last.ckpt<suffix>`: a name beside `path` that no checkpoint search takes for one."""
    return path.parent / f".{path.name}{suffix}"


def replace_folder(partial: Path, path: Path) -> None:
    """Give the complete folder `partial` the name `path`, where the previous checkpoint (a folder or a file) may be.

    A folder cannot be renamed over a non-empty one, so the previous one first steps aside (`hidden(path,
    OLD_SUFFIX)`), then `partial` takes its name, then the previous one is deleted. A kill between the two renames
    leaves no `path` but the previous checkpoint whole under its hidden name: `clear_leftovers` puts it back.
    """
    old = hidden(path, OLD_SUFFIX)
    remove(old)
    for file in partial.iterdir():  # on disk before the name says complete (the shards' writer syncs its own)
        if file.is_file():
            with open(file, "rb") as opened:
                os.fsync(opened.fileno())
    if path.exists():
        os.replace(path, old)
    os.replace(partial, path)
    _fsync_folder(path.parent)
    remove(old)


def clear_leftovers(folder: Path) -> list[Path]:
    """Undo what saves killed part-way left in `folder`: a partial checkpoint (`.<name>.ckpt.partial`, a file or a
    folder) is deleted; a previous checkpoint that stepped aside (`.<name>.ckpt.old`) is deleted where the new one
    took its name and renamed back where it did not. Returns the checkpoints put back."""
    restored = []
    for partial in folder.glob(f".*.ckpt{PARTIAL_SUFFIX}"):
        remove(partial)
    for old in folder.glob(f".*.ckpt{OLD_SUFFIX}"):
        path = folder / old.name[1 : -len(OLD_SUFFIX)]
        if path.exists():
            remove(old)
        else:
            os.replace(old, path)
            restored.append(path)
    return restored


def remove(path: Path) -> None:
    """Delete a checkpoint path, a file or a folder, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def no_room(path: Path, needed: int) -> str:
    """The one line for a checkpoint that does not fit: the folder, its free space, what is needed, the fix."""
    free = shutil.disk_usage(path.parent).free
    return (
        f"checkpoint {path.name} not written: {path.parent} has {_size(free)} free and the checkpoint needs about "
        f"{_size(needed)} (the previous {path.name} is kept until a new one is complete); free that much there, or "
        "point trainer.default_root_dir (or the checkpoint callback's dirpath) at a disk with room"
    )


def tensor_bytes(checkpoint: Any) -> int:
    """The bytes of every tensor storage in `checkpoint` once each (tied weights share one): a checkpoint file's
    size but for its few kB of pickled structure."""
    storages = {}
    for tensor in _tensors(checkpoint):
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[(tensor.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _full_disk(error: BaseException | None) -> bool:
    """Whether `error`, or one it was raised while handling, is a full disk or quota: torch's zip writer answers
    a failed write with its own `RuntimeError` when it closes the archive, the `OSError` in its context."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in FULL_DISK:
            return True
        error = error.__cause__ or error.__context__
    return False


def _link(file: IO[bytes], name: Path) -> None:
    """Give an `O_TMPFILE` file a name. Through `/proc/self/fd` as a folder: Python's `os.link` follows the
    link (`linkat(AT_SYMLINK_FOLLOW)`) only when given a folder descriptor, and links the symlink itself otherwise."""
    proc = os.open("/proc/self/fd", os.O_RDONLY)
    try:
        os.link(str(file.fileno()), name, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} bytes"
