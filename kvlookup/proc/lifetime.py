"""Process lifetime primitives: children that die with their parent, and ``flock`` files.

* :func:`set_parent_death_signal` / :func:`dies_with_parent`: Linux ``prctl(PR_SET_PDEATHSIG)``
  through ctypes. The kernel sends the signal when the *thread* that forked the child exits, so
  fork from a thread that lives as long as the process (the main thread, or a supervisor
  thread that runs until exit). Elsewhere (no prctl) they do nothing and return False.
* :class:`FileLock`: an advisory ``flock`` on a file. The kernel drops it when every file
  descriptor of the holder is closed, kill -9 included, so a lock's state says exactly whether
  its holder lives. A forked child shares its parent's lock (same open file description).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _prctl():
    """libc's ``prctl``, resolved in the parent (never after a fork), or None off Linux."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def set_parent_death_signal(sig: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent (thread) exits.

    parent: the pid the caller expects as its parent; if it is already gone (reparented), the
    signal is sent at once, closing the race between fork and prctl. True when set.
    """
    if _PRCTL is None or _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def dies_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``subprocess.Popen(preexec_fn=...)`` that makes the child get ``sig`` when the calling
    thread's process (its parent) dies. Call it in the parent, right before Popen."""
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal(sig, parent)

    return preexec


class LockTimeout(TimeoutError):
    """The lock stayed held by another process past the deadline."""


class FileLock:
    """An exclusive (or shared) ``flock`` on ``path``, created if missing.

    ``try_acquire()`` never blocks; ``acquire(timeout)`` waits up to ``timeout`` seconds
    (raises :class:`LockTimeout`); ``release()`` unlocks and closes. Usable as a context manager
    (``acquire()`` with the default timeout). ``read()`` / ``write()`` access the file's text
    (locks are advisory, anyone may read).
    """

    def __init__(self, path: str | os.PathLike, *, shared: bool = False, timeout: float = 30.0,
                 create: bool = True):
        self.path = Path(path)
        self.shared = shared
        self.timeout = timeout
        self.create = create
        self.fd: int | None = None

    def try_acquire(self) -> bool:
        """Take the lock if free now; True when held by this object. With ``create=False`` a
        missing file raises FileNotFoundError."""
        if self.fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT if self.create else 0), 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        self.fd = fd
        return True

    def acquire(self, timeout: float | None = None) -> FileLock:
        """Wait (polling every 20 ms) until the lock is ours; raises LockTimeout."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not self.try_acquire():
            if time.monotonic() > deadline:
                raise LockTimeout(f"{self.path} stayed locked by another process")
            time.sleep(0.02)
        return self

    def release(self) -> None:
        """Unlock (closing the descriptor). Safe to call when not held."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def held_elsewhere(self) -> bool:
        """True when another process holds the lock (probes without keeping it)."""
        if self.fd is not None:
            return False
        probe = FileLock(self.path, shared=True)
        if probe.try_acquire():
            probe.release()
            return False
        return True

    def read(self) -> str:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return ""

    def write(self, text: str) -> None:
        """Replace the file's text in place (the lock stays on the same inode)."""
        assert self.fd is not None, "write needs the lock"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)

    def __enter__(self) -> FileLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class Backoff:
    """Restart delays in seconds: ``first``, doubling up to ``cap`` while restarts keep failing,
    back to ``first`` once the process had stayed up ``stable`` seconds."""

    def __init__(self, first: float, cap: float, stable: float = float("inf")):
        self.first, self.cap, self.stable = first, cap, stable
        self.delay = first

    def reset(self) -> None:
        """Back to the first delay (the last attempt succeeded)."""
        self.delay = self.first

    def next(self, up_for: float = 0.0) -> float:
        """The delay before the next start; ``up_for``: how long the last run lasted (0 = it
        did not start)."""
        if up_for >= self.stable:
            self.delay = self.first
        delay, self.delay = self.delay, min(self.delay * 2, self.cap)
        return delay


def release_memory() -> bool:
    """Give freed heap memory back to the OS (a collection, then glibc's ``malloc_trim``), e.g.
    after a burst of ingest drained: Python and malloc keep freed pages otherwise. True when
    malloc_trim ran (glibc only)."""
    import gc

    gc.collect()
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False
