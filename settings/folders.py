"""Folders only this user may use: the DRAM tier's, the LMDB tier's and the outcome box's, which hold every tenant's
KV (or what ran for it) at paths anyone on the host can predict, some of them in a folder every local user may
write to (/dev/shm).

Each is created 0700 (its missing parents as the umask says), its files 0600. One that is there already is used
only when it is a real folder (not a symbolic link) of this effective uid that neither group nor others may write
to: anything else could let another user read entries or plant them. One of ours that others may only read or
enter (0755, as earlier versions made them) is tightened to 0700, its files to 0600.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

FOLDER_MODE = 0o700
FILE_MODE = 0o600
_FIX = "remove it, or point the setting at another path, and start again: it is then created, mode 0700"


def make_private_folder(path: Path) -> bool:
    """Create ``path`` 0700 (its missing parents as the umask says); False when something is there already."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, FOLDER_MODE)
    except FileExistsError:
        return False
    os.chmod(path, FOLDER_MODE)  # mkdir's mode is under the umask; exactly this one is wanted
    return True


def private_folder(path: Path, *, what: str, create: bool = True) -> bool:
    """Make ``path`` a folder only this user can use (``create``; module docstring), or check the one there: raises
    PermissionError naming ``what`` (say, "the outcomes folder") for a symbolic link, something not a folder, a
    folder of another user's or one that group or others may write to; without ``create`` a missing folder raises
    FileNotFoundError. Returns whether the folder was created."""
    if create and make_private_folder(path):
        return True
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(f"{what} {path} is a symbolic link, not a folder of its own: {_FIX}")
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{what} {path} exists and is not a directory: {_FIX}")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{what} {path} is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}, "
                              f"so another user could read or plant entries: {_FIX}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{what} {path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}), "
                              f"so another user could have planted entries: {_FIX}")
    if st.st_mode & 0o077:
        tighten(path)
    return False


def tighten(path: Path, names: Iterable[str] | None = None) -> None:
    """chmod 0700 a folder of ours, and 0600 its files of ours that others may read (``names``, or every one); a
    link is left as it is, and a file removed meanwhile (by another process of the store) skipped."""
    os.chmod(path, FOLDER_MODE)
    for name in (names if names is not None else os.listdir(path)):
        try:
            st = os.lstat(path / name)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
                os.chmod(path / name, FILE_MODE)
        except FileNotFoundError:
            continue
