"""Writing outputs without losing work: refuse to overwrite, write to a temporary sibling, rename into place.

Every command that writes a file or folder goes through here. An existing output is replaced only when the user
says so (`--overwrite-output-dir`, the `TrainingArguments` convention), and the new output is first written next to
the old one under a hidden temporary name, then renamed over it, so an interrupted run leaves the old output whole
(or nothing) rather than a half-written mix; the new output gets the permissions the umask gives (not 0600).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

from eagle3_hf.utils.atomic import replace_path, temporary_sibling

__all__ = ["check_output_dir", "check_output_file", "staged_dir", "staged_file"]

_OVERWRITE_HINT = "pass --overwrite-output-dir to replace it"


def _same_path(a: str, b: str) -> bool:
    return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)


def check_output_dir(
    path: str, overwrite: bool, flag: str = "output", resumable: bool = False, source: str | None = None
) -> None:
    """Raise `ValueError` unless `path` may be written as a folder.

    A missing or empty folder is fine; an existing file never is; a non-empty folder only with `overwrite` (or, when
    `resumable`, to be resumed by the caller). `source` is an input the command reads: writing over it is refused.
    """
    if source is not None and os.path.exists(source) and os.path.exists(path):
        inside = os.path.commonpath([os.path.realpath(path), os.path.realpath(source)]) == os.path.realpath(path)
        if _same_path(path, source) or inside:
            raise ValueError(f"{flag} {path!r} is (or holds) the checkpoint being read, {source!r}; write elsewhere.")
    if os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} is an existing file; expected a folder (missing or empty).")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        resume = " or --resume to continue the run in it" if resumable else ""
        raise ValueError(f"{flag} {path!r} already exists and is not empty; {_OVERWRITE_HINT}{resume}.")


def check_output_file(path: str, overwrite: bool, flag: str = "output") -> None:
    """Raise `ValueError` unless `path` may be written as a file (missing, or existing and `overwrite`)."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a folder; expected a file name.")
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"{flag} {path!r} already exists; {_OVERWRITE_HINT}.")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path!r}: the folder {parent!r} does not exist.")


@contextlib.contextmanager
def staged_dir(path: str) -> Iterator[str]:
    """Yield a temporary sibling folder of `path` to write into; on success it replaces `path`, on error it goes.

    The old folder (if any) is moved aside and deleted only once the new one is in place.
    """
    temporary = temporary_sibling(path, directory=True)
    try:
        yield temporary
        replace_path(temporary, path)
    finally:
        if os.path.isdir(temporary):
            shutil.rmtree(temporary)


@contextlib.contextmanager
def staged_file(path: str) -> Iterator[str]:
    """Yield a temporary sibling file name of `path` to write; on success it is renamed over `path` (atomic)."""
    temporary = temporary_sibling(path, directory=False)
    try:
        yield temporary
        replace_path(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
