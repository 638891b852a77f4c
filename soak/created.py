"""The names made in one folder, as the kernel reports them (Linux inotify, through libc).

The soak's store-write fault freezes a worker while its put's temporary file exists. Polling the folder misses a
put shorter than one poll when both cores are busy (a CI run saw none of about a hundred puts in 90 s); the kernel's
creation event wakes the watcher the moment the file is made.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
from pathlib import Path

IN_CREATE = 0x00000100
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name


class Created:
    """``names(timeout)`` gives the names created in ``folder`` since the last call (empty when none came in time)."""

    def __init__(self, folder: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_CLOEXEC | os.O_NONBLOCK)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_init1: {os.strerror(ctypes.get_errno())}")
        if libc.inotify_add_watch(self._fd, os.fsencode(folder), IN_CREATE) < 0:
            errno = ctypes.get_errno()
            os.close(self._fd)
            raise OSError(errno, f"inotify_add_watch {folder}: {os.strerror(errno)}")

    def names(self, timeout: float) -> list[str]:
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return []
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return []
        names, offset = [], 0
        while offset + _EVENT.size <= len(data):
            _, mask, _, length = _EVENT.unpack_from(data, offset)
            name = data[offset + _EVENT.size: offset + _EVENT.size + length].rstrip(b"\0")
            offset += _EVENT.size + length
            if mask & IN_CREATE and name:
                names.append(os.fsdecode(name))
        return names

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> Created:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
