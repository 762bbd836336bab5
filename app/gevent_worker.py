"""gunicorn's gevent worker, patched without the ssl warning, quitting once per Ctrl-C;
kvlookup.proc.green.patched tells code that must wait cooperatively (control calls, body
deadlines) whether it runs inside one.

gunicorn patches the standard library in each worker after the fork, while the controller's
master process has already imported ``ssl`` (through redis-py), so gevent warns on every
start. Nothing SSL exists yet at that point (the master talks to an embedded Redis in plain
TCP; clients, rediss:// ones included, are created per worker after patching), so the
warning is noise and is filtered here; every other gevent warning still shows.

Ctrl-C in a terminal sends SIGINT to the whole process group: each worker gets it from the
terminal and then SIGQUIT from the master, which handles SIGINT by stopping its workers. gunicorn
answers each quit signal with a greenlet that calls ``sys.exit(0)``; the second one fires while
the worker is already exiting, and gevent prints its SystemExit as a traceback. The worker here
quits on the first signal and ignores the ones after it.

A lookup answered from the controller's cached reads (kvlookup.index.tracking) does no I/O, so its
greenlet never yields: on a busy keep-alive connection it would go on serving its own requests
while the others wait (measured with wrk, 12-token prompts, c=4: p99 450-700 ms, p50 0.8 ms).
The worker yields after every request, so connections take turns (p99 2-3 ms).
"""

from __future__ import annotations

import warnings

import gevent
from gevent.monkey import MonkeyPatchWarning
from gunicorn.workers.ggevent import GeventWorker as _GunicornGeventWorker


class GeventWorker(_GunicornGeventWorker):
    """``worker_class = "kvlookup.app.gevent_worker.GeventWorker"``."""

    quitting = False

    def handle_quit(self, sig, frame) -> None:
        """SIGINT/SIGQUIT: quit (gunicorn's quick exit) on the first, ignore any later one."""
        if self.quitting:
            return
        self.quitting = True
        super().handle_quit(sig, frame)

    def handle_request(self, *args, **kwargs):
        """gunicorn's, then a turn for every other greenlet (see the module docstring)."""
        try:
            return super().handle_request(*args, **kwargs)
        finally:
            gevent.sleep(0)

    def patch(self) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Monkey-patching ssl after ssl", category=MonkeyPatchWarning)
            super().patch()
