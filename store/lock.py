"""One writer per checkpoint: an advisory lock file per checkpoint beside the store, taken by extraction (the whole
write), ``rm`` (the rename out of the store) and ``measure`` (the write of the metrics: a group removed before is
skipped, never half recreated).

``fcntl.flock`` is held for as long as the extraction runs; the kernel releases it when the process ends however it
ends, so a lock left by a dead process is taken over by the next writer. The file holds the owner's host, pid and what it does,
for the message a second writer prints while it waits, and is removed on release; a writer that acquired a file
removed meanwhile (its inode no longer at the path) tries again, so two writers never both hold the lock.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)


def _owner(f) -> str:
    f.seek(0)
    return f.read().strip() or "unknown"


@contextlib.contextmanager
def checkpoint_lock(path: Path, what: str, poll: float = 0.5, doing: str = "extracted") -> Iterator[None]:
    """Hold the lock at ``path``; while another process holds it, say so once and wait.

    Parameters
    ----------
    path
        The lock file (``StoreLayout.checkpoint(ckpt).lock``, layout.py).
    what
        What it guards, for the message (the checkpoint's group).
    poll
        Seconds between tries while another process holds it.
    doing
        What this process does with it, for the message of another that waits (``extracted``, ``measured``,
        ``removed``).

    Yields
    ------
    None
        While the lock is held.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    told = False
    while True:
        try:
            f = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666), "a+")
        except FileNotFoundError:  # its folder was pruned by a run that just finished: make it again
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not told:
                owner, _, theirs = _owner(f).partition("; ")
                log.info("%s is being %s by another process (%s); waiting for it to finish", what, theirs or "extracted",
                         owner)
                told = True
            f.close()
            time.sleep(poll)
            continue
        try:
            if os.path.exists(path) and os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()  # the file was removed by the previous owner after we opened it: try again
    try:
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()}, pid {os.getpid()}; {doing}")
        f.flush()
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        f.close()  # releases the lock
