"""The lock file beside a store's segment: where it lives, and taking an ``flock``
on it that holds even when ``unlink`` removes the file while a process waits.
"""

from __future__ import annotations

import fcntl
import os
import tempfile


def lock_file_path(name: str) -> str:
    if not name or "/" in name or "\0" in name or len(name) > 200:
        raise ValueError(f"invalid store name {name!r}")
    directory = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(directory, f"{name}.lock")


def acquire_lock_file(name: str, mode: int) -> tuple[int, str]:
    """An open, flock'ed descriptor on the store's lock file, and its path."""
    path = lock_file_path(name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, mode)
            if _is_file_at(fd, path):
                return fd, path
        except BaseException:
            os.close(fd)
            raise
        # unlink() removed the file while we waited: lock the file that is there now.
        os.close(fd)


def _is_file_at(fd: int, path: str) -> bool:
    try:
        at_path = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


def remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
