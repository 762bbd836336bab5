"""Real processes around the shared embedded Redis of a data dir: users, keepers, servers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.procs import ROOT

USER_SCRIPT = """
import json, sys
from kvlookup.config import Settings
from kvlookup.proc.runtime import ensure_redis
lease = ensure_redis(Settings(data_dir=sys.argv[1]))
print(json.dumps(lease.info), flush=True)
sys.stdin.read()
lease.stop()
"""


class UserProc:
    """A process using the embedded Redis of ``data_dir`` until :meth:`leave` (or kill -9).
    ``info`` is the server record it got (pid = keeper, url, server_pid, mode)."""

    def __init__(self, data_dir: Path):
        self.proc = subprocess.Popen([sys.executable, "-c", USER_SCRIPT, str(data_dir)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.info: dict = {}

    def ready(self) -> UserProc:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"user process exited with {self.proc.wait()}")
        self.info = json.loads(line)
        return self

    def leave(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(15)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


def alive(pid: int | None) -> bool:
    """True when ``pid`` runs (a zombie is not running)."""
    if not pid:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def servers_of(data_dir: Path) -> list[int]:
    """Pids of the running valkey/redis servers whose working directory is ``data_dir``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            comm = (proc / "comm").read_text().strip()
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if comm in ("valkey-server", "redis-server") and Path(cwd) == data_dir.resolve() and alive(int(proc.name)):
            found.append(int(proc.name))
    return sorted(found)


def keepers_of(data_dir: Path) -> list[int]:
    """Pids of running keepers (``kvlookup redis --exit-when-unused``) of ``data_dir``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--exit-when-unused" in argv and str(data_dir).encode() in argv and alive(int(proc.name)):
            found.append(int(proc.name))
    return sorted(found)


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)

