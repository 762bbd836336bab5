"""The controller's HTTP API (Flask, with /lookup in front of it). Gunicorn serves
``create_asgi_app()`` with uvicorn workers (the default) or ``create_app()`` with WSGI workers.

Nothing binds at import time: ``create_app`` builds the Redis client and the lookup client
per app (per gunicorn worker, since the app is not preloaded).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flask import Flask, jsonify, request
from flask.json.provider import DefaultJSONProvider

from kvlookup import config as kvconfig
from kvlookup import native
from kvlookup.client import Client, VllmChains
from kvlookup.proc.redis_server import connect


def create_app(settings: kvconfig.Settings | Mapping[str, Any] | None = None) -> Flask:
    """Build the controller app.

    settings: a Settings object, a mapping of setting overrides, or None (defaults, then the
    file named by ``KVLOOKUP_CONFIG`` and ``KVLOOKUP_*`` variables). The Redis URL must be set
    (the CLI starts an embedded Redis and passes its URL). Raises ValueError on bad settings.
    """
    import os

    if not isinstance(settings, kvconfig.Settings):
        settings = kvconfig.load(os.environ.get("KVLOOKUP_CONFIG"), overrides=settings or {})
    native.configure(settings.native)  # C decode + hash of /lookup, or pure Python (kvlookup.native)
    if not settings.redis_url:
        raise ValueError("redis_url is not set (KVLOOKUP_REDIS_URL, --redis-url, or run `kvlookup controller`)")
    app = Flask(__name__)
    assert isinstance(app.json, DefaultJSONProvider)  # Flask's own, as no json_provider_class is set
    app.json.sort_keys = False
    # one bounded pool per worker process: under gevent every lookup in flight holds a
    # connection, so a burst waits (up to 5 s) for one instead of failing at once
    redis_client = connect(settings.redis_url, cluster=settings.redis_cluster, socket_timeout=5,
                           health_check_interval=30, max_connections=settings.redis_max_connections)
    client = Client(redis=redis_client, profile=settings.profile(), max_tokens=settings.max_tokens,
                    instance_ttl_s=settings.instance_ttl_s, worker_ttl_s=settings.worker_ttl_s,
                    cache_reads=settings.cache_reads(), cache_keys=settings.lookup_cache_keys,
                    extra_chains=[VllmChains(redis_client, check_alive=settings.instance_ttl_s > 0)])
    from kvlookup.app import control, dashboard, errors, health, lookup, metrics_view, overview, registry, tokenizer
    from kvlookup.app.body import RequestBody
    from kvlookup.index.fleet import Fleet
    from kvlookup.wire.lmcache_control import ControlClient

    fleet = Fleet(client.store)
    app.extensions["kvlookup"] = {
        "settings": settings,
        "redis": redis_client,
        "client": client,
        "fleet": fleet,
        "control": ControlClient(settings.control_timeout_s, settings.control_retries,
                                 networks=settings.worker_nets()),
        "metrics_registries": metrics_view.build_registries(fleet),
    }
    errors.init_app(app)
    from kvlookup.app.auth import host_allowed

    @app.before_request
    def _host_check():  # DNS rebinding: a loopback-bound controller answers loopback names only
        if not host_allowed(request.headers.get("Host"), settings.host):
            return jsonify(error="Host is not this controller's (bound to loopback)"), 421
        return None
    app.register_blueprint(health.bp)
    app.register_blueprint(control.bp)
    app.register_blueprint(registry.bp)
    app.register_blueprint(metrics_view.bp)
    app.register_blueprint(dashboard.bp)
    app.register_blueprint(overview.bp)
    from kvlookup.app import openapi

    app.register_blueprint(openapi.bp)
    from kvlookup.app import coordinator

    coordinator.init_app(app, redis_client, settings)  # LMCache MP coordinator paths
    if tokenizer.available():
        app.register_blueprint(tokenizer.bp)
    from kvlookup.index.explain import Explainer

    explainer = Explainer(client, hash_seed=settings.hash.get("hash_seed"))
    routed = lookup.LookupRoute(app.wsgi_app, client, settings.lookup_response, settings.max_tokens, explainer,
                                mp=coordinator.Scoper(app.extensions["kvlookup"]["mp"]))
    app.wsgi_app = RequestBody(routed, settings.max_body_bytes, settings.body_timeout_s)  # type: ignore[method-assign]
    app.extensions["kvlookup"]["lookup_route"] = routed
    return app


def create_asgi_app(settings: kvconfig.Settings | Mapping[str, Any] | None = None):
    """The controller as an ASGI app (:class:`app.asgi.AsgiController` around
    :func:`create_app`'s Flask app): what the default uvicorn workers serve. Explains are
    answered by a child process with the same app (:mod:`app.explain_pool`)."""
    from kvlookup.app import health
    from kvlookup.app.asgi import AsgiController
    from kvlookup.app.explain_pool import ExplainPool

    flask_app = create_app(settings)
    ext = flask_app.extensions["kvlookup"]
    s = ext["settings"]
    explains = ExplainPool(create_app, s)
    health.health_checks(flask_app).append(explains.health)
    return AsgiController(flask_app, ext["lookup_route"], s.max_body_bytes, s.body_timeout_s, bind_host=s.host,
                          explains=explains)
