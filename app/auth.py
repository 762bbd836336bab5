"""Guards for mutating endpoints (clear, pin, compress, decompress, move) and the Host check.

With ``api_token`` set, a mutating request must carry ``Authorization: Bearer <token>``;
otherwise 401 ``{"error": ...}`` with a ``WWW-Authenticate: Bearer`` header. With it unset
(LMCache's controller has no authentication; bind to loopback, the default, or set a token) a
web page must still not drive them (issue 20): a mutating request must say
``Content-Type: application/json`` (415 otherwise: a cross-origin ``text/plain`` form post is
not), and one a browser sends (an ``Origin`` or ``Sec-Fetch-Site`` header) is refused 403.

:func:`host_allowed`: a controller bound to loopback answers only requests whose ``Host`` names
loopback (``localhost``, ``127.x``, ``[::1]``), so a DNS-rebinding page cannot read answers.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress

from flask import current_app, jsonify, request


def require_token(view):
    """Decorator: enforce the configured bearer token on ``view``."""

    @functools.wraps(view)
    def wrapped(*args, **kwargs):
        token = current_app.extensions["kvlookup"]["settings"].api_token
        if token:
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
                resp = jsonify(error="missing or invalid bearer token (Authorization: Bearer <api_token>)")
                resp.status_code = 401
                resp.headers["WWW-Authenticate"] = 'Bearer realm="kvlookup"'
                return resp
        elif refused := _browser_refusal():
            resp = jsonify(error=refused[1])
            resp.status_code = refused[0]
            return resp
        return view(*args, **kwargs)

    return wrapped


def _browser_refusal() -> tuple[int, str] | None:
    """(status, message) when a tokenless mutating call could come from a web page."""
    if request.headers.get("Origin") or request.headers.get("Sec-Fetch-Site") not in (None, "none"):
        return 403, "mutating calls from a browser need api_token (set it, and send Authorization: Bearer)"
    if request.mimetype != "application/json":
        return 415, "Content-Type must be application/json"
    return None


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is loopback (``localhost``, 127/8, ::1); kept per name
    (every /lookup asks twice, and parsing an address costs more than the lookup's hashing)."""
    if host.lower() in ("localhost", "localhost.") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_allowed(host_header: str | None, bind_host: str) -> bool:
    """A request's ``Host`` is acceptable for a controller bound to ``bind_host``: anything when
    it is not bound to loopback; else a loopback name (DNS rebinding names another host)."""
    if not is_loopback(bind_host):
        return True
    if not host_header:
        return True  # HTTP/1.0 without Host: not a browser
    name = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
    return is_loopback(name)
