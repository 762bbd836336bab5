"""``GET /``: the fleet dashboard, plain HTML, CSS and JavaScript shipped in ``app/static``.

No build step and nothing from outside: the page (``static/index.html``) loads
``static/dashboard.css`` and ``static/dashboard.js``, which poll ``GET /controller/overview``
and ``GET /metrics`` every few seconds, draw their charts as inline SVG, and look prompts up
through ``POST /lookup`` (and ``POST /tokenize`` / ``POST /lookup/explain`` where those answer).
Every call it makes is read-only, so it needs no API token.
"""

from __future__ import annotations

from flask import Blueprint, current_app

bp = Blueprint("dashboard", __name__)

#: The page runs only its own files: no inline script, no other origin, no framing.
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


@bp.get("/")
def index():
    """The dashboard page (text/html)."""
    resp = current_app.send_static_file("index.html")
    resp.headers["Content-Security-Policy"] = CSP
    resp.headers["Cache-Control"] = "no-cache"
    return resp
