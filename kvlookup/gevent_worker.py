"""gunicorn's gevent worker, patched without the ssl warning; :func:`patched` tells code that
must wait cooperatively (control calls, body deadlines) whether it runs inside one.

gunicorn patches the standard library in each worker after the fork, while the controller's
master process has already imported ``ssl`` (through redis-py), so gevent warns on every
start. Nothing SSL exists yet at that point (the master talks to an embedded Redis in plain
TCP; clients, rediss:// ones included, are created per worker after patching), so the
warning is noise and is filtered here; every other gevent warning still shows.
"""

from __future__ import annotations

import warnings

from gevent import monkey
from gevent.monkey import MonkeyPatchWarning
from gunicorn.workers.ggevent import GeventWorker as _GunicornGeventWorker


def patched() -> bool:
    """True in a process gevent has patched (a gevent worker): blocking waits must then be
    gevent's (green ZMQ sockets, gevent.Timeout) or they stall every greenlet."""
    return monkey.is_module_patched("socket")


class GeventWorker(_GunicornGeventWorker):
    """``worker_class = "kvlookup.gevent_worker.GeventWorker"``."""

    def patch(self) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Monkey-patching ssl after ssl", category=MonkeyPatchWarning)
            super().patch()
