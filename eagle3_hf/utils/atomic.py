"""Whole-or-nothing writes with ordinary permissions, for every layer of the package.

Outputs are written under a temporary name next to where they go, then renamed into place (a rename within a folder
is atomic), so an interrupted run leaves the old output or the new one, never half of one. Temporary files made
with `tempfile` (0600, 0700) and files written by safetensors (0600) would keep modes that other users of a shared
machine, or a serving process running as another user, cannot read: `apply_umask` gives them the mode any other new
file gets. This sits in the lowest layer (it imports nothing of ours) so that `training` and `modeling` can use it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading

__all__ = ["apply_umask", "replace_path", "temporary_sibling", "umask"]

_UMASK_LOCK = threading.Lock()


def umask() -> int:
    """The process's umask. POSIX can only read it by setting it, so it is set back at once (under a lock)."""
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def apply_umask(path: str | os.PathLike, suffix: str | None = None) -> None:
    """Give `path` the mode the umask gives new files and folders (0644 and 0755 under umask 022): a file; a folder
    and everything in it; or, with `suffix`, only the files directly in the folder whose names end with it. Links
    are left alone."""
    mask = umask()
    path = os.fspath(path)
    if suffix is not None:
        for name in os.listdir(path):
            if name.endswith(suffix) and os.path.isfile(os.path.join(path, name)):
                apply_umask(os.path.join(path, name))
        return
    if os.path.islink(path):
        return
    if not os.path.isdir(path):
        os.chmod(path, 0o666 & ~mask)
        return
    os.chmod(path, 0o777 & ~mask)
    for root, folders, files in os.walk(path):
        for name, mode in [(n, 0o777) for n in folders] + [(n, 0o666) for n in files]:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), mode & ~mask)


def temporary_sibling(path: str | os.PathLike, directory: bool) -> str:
    """A new hidden file or folder next to `path` (same folder, so renaming it onto `path` is atomic)."""
    parent, name = os.path.split(os.path.abspath(os.fspath(path)))
    os.makedirs(parent, exist_ok=True)
    if directory:
        return tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    handle, temporary = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    os.close(handle)
    return temporary


def replace_path(new: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename `new` onto `path` with the umask's permissions. An existing folder (which a plain rename cannot
    replace) is moved aside first and deleted only once `new` is in place."""
    new, path = os.fspath(new), os.fspath(path)
    apply_umask(new)
    old = None
    if os.path.lexists(path) and (os.path.isdir(new) or os.path.isdir(path)):
        old = temporary_sibling(path, directory=True)
        os.rmdir(old)
        os.replace(path, old)
    os.replace(new, path)
    if old is not None:
        shutil.rmtree(old) if os.path.isdir(old) and not os.path.islink(old) else os.remove(old)
