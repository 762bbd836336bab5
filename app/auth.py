"""Bearer-token guard for mutating endpoints (clear, pin, compress, decompress, move).

With ``api_token`` unset every request passes (LMCache's controller has no authentication;
bind to loopback, the default, or set a token). With it set, a request must carry
``Authorization: Bearer <token>``; otherwise 401 ``{"error": ...}`` with a
``WWW-Authenticate: Bearer`` header.
"""

from __future__ import annotations

import functools
import hmac

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
        return view(*args, **kwargs)

    return wrapped
