"""Is this process a gevent worker? Code that must wait cooperatively (control calls, body
deadlines) asks here, without importing gevent into processes that never use it (sidecars)."""

from __future__ import annotations

import sys


def patched() -> bool:
    """True in a process gevent has patched (a gevent worker): blocking waits must then be
    gevent's (green ZMQ sockets, gevent.Timeout) or they stall every greenlet."""
    monkey = sys.modules.get("gevent.monkey")
    return bool(monkey and monkey.is_module_patched("socket"))
