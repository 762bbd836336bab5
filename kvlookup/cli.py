"""``kvlookup`` command line: controller, sidecar, redis, hash, demo, quickstart, bench."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import subprocess
import sys
import threading
from typing import Any

from kvlookup import config as kvconfig
from kvlookup.runtime import GunicornController, ensure_redis, setup_logging

log = logging.getLogger("kvlookup")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="kvlookup YAML settings file (see config/)")
    p.add_argument("--redis-url", help="redis://, rediss:// or unix:// URL (default: embedded Redis)")
    p.add_argument("--data-dir", help="embedded Redis data dir (default ~/.local/share/kvlookup)")
    p.add_argument("--instance-ttl", type=float, dest="instance_ttl_s",
                   help="seconds an instance stays live without its sidecar's heartbeat (0 = off)")
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING, ERROR")


def _hash_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lmcache-config", help="the engines' LMCache YAML (chunk_size, save_unfull_chunk)")
    p.add_argument("--chunk-size", type=int, help="tokens per chunk (256)")
    p.add_argument("--save-unfull-chunk", action=argparse.BooleanOptionalAction, default=None,
                   help="hash the trailing partial chunk (default on)")
    p.add_argument("--none-hash", help="0, 'seed' (hash of PYTHONHASHSEED, as vLLM sets it) or an integer")
    p.add_argument("--hash-seed", help="the engines' PYTHONHASHSEED (default: this process's)")
    p.add_argument("--extra-keys", choices=["empty", "none", "absent", "sha256"],
                   help="LMCache era: empty (0.4+), none (0.3.4-0.3.15), absent (0.3.3), sha256 (0.3.0-0.3.2)")


def _overrides(args: argparse.Namespace, names: tuple[str, ...]) -> dict[str, Any]:
    out = {n: getattr(args, n, None) for n in names}
    hash_keys = {"chunk_size": "chunk_size", "save_unfull_chunk": "save_unfull_chunk",
                 "none_hash": "none_hash", "hash_seed": "hash_seed", "extra_keys": "extra_keys"}
    hashes = {k: getattr(args, a) for k, a in hash_keys.items() if getattr(args, a, None) is not None}
    if hashes:
        out["hash"] = hashes
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlookup", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("controller", help="serve POST /lookup (gunicorn); optional embedded sidecar")
    _common(c)
    _hash_flags(c)
    c.add_argument("--host", help="HTTP bind host (default 127.0.0.1)")
    c.add_argument("--port", type=int, help="HTTP port (default 9000)")
    c.add_argument("--monitor-port", type=int, help="run an embedded sidecar with its PULL socket on this port")
    c.add_argument("--monitor-ports", type=json.loads, help='JSON {"pull": P, "reply": R} for the embedded sidecar')
    c.add_argument("--workers", type=int, dest="gunicorn_workers", help="gunicorn worker processes (2)")
    c.add_argument("--threads", type=int, dest="gunicorn_threads", help="threads per worker (4)")
    c.add_argument("--lookup-response", choices=kvconfig.LOOKUP_RESPONSES, help="flat (default) or layout_info")
    c.set_defaults(func=cmd_controller)

    s = sub.add_parser("sidecar", help="ingest LMCache worker traffic into Redis")
    _common(s)
    s.add_argument("--instance-id", help="the instance this sidecar vouches for (traffic adds others)")
    s.add_argument("--pull-url", help="host:port to bind PULL (LMCache controller_pull_url)")
    s.add_argument("--reply-url", help="host:port to bind ROUTER (LMCache controller_reply_url, 0.3.12+)")
    s.add_argument("--advertise-reply", help="host:port workers use for heartbeats (default: reply url)")
    s.set_defaults(func=cmd_sidecar)

    r = sub.add_parser("redis", help="run the embedded Redis in the foreground and print its URL")
    r.add_argument("--data-dir")
    r.add_argument("--port", type=int, default=0)
    r.set_defaults(func=cmd_redis)

    h = sub.add_parser("hash", help="print a prompt's chunk hashes under a hash profile")
    _hash_flags(h)
    h.add_argument("tokens", help="token ids, comma separated or a JSON list")
    h.set_defaults(func=cmd_hash)

    d = sub.add_parser("demo", help="send LMCache worker traffic for real prompts, then look them up")
    d.add_argument("--pull-url", default="localhost:9001")
    d.add_argument("--reply-url", help="needed for --era 0.5")
    d.add_argument("--http", default="http://localhost:9000")
    d.add_argument("--era", choices=["0.3", "0.5"], default="0.3")
    _hash_flags(d)
    d.set_defaults(func=cmd_demo)

    q = sub.add_parser("quickstart", help="controller + embedded Redis + sidecar on the seed's ports, then the demo")
    q.add_argument("--port", type=int, default=9000)
    q.add_argument("--monitor-port", type=int, default=9001)
    q.add_argument("--data-dir")
    q.set_defaults(func=cmd_quickstart)
    _add_bench(sub)
    return parser


def _add_bench(sub) -> None:
    """``kvlookup bench ...`` lives in bench/ (needs the ``bench`` extra: matplotlib, tqdm)."""
    try:
        from bench.runner import add_parser
    except ImportError as exc:
        reason = str(exc)
        b = sub.add_parser("bench", help="benchmarks (needs: pip install 'kvlookup[bench]')")
        b.set_defaults(func=lambda _a: _missing_bench(reason))
        return
    add_parser(sub)


def _missing_bench(reason: str) -> int:
    print(f"kvlookup bench: {reason}; install the extra: pip install 'kvlookup[bench]'", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvlookup: error: {exc}", file=sys.stderr)
        return 2


# -- commands --------------------------------------------------------------------------------

CONTROLLER_SETTINGS = ("redis_url", "data_dir", "instance_ttl_s", "log_level", "lmcache_config", "host",
                       "port", "monitor_port", "monitor_ports", "gunicorn_workers", "gunicorn_threads",
                       "lookup_response")


def cmd_controller(args: argparse.Namespace) -> int:
    settings = kvconfig.load(args.config, overrides=_overrides(args, CONTROLLER_SETTINGS))
    setup_logging(settings.log_level)
    server = ensure_redis(settings)
    child = None
    try:
        if settings.pull_port():
            child = _spawn_embedded_sidecar(settings)
        GunicornController(settings).run()
    finally:
        if child is not None:
            child.terminate()
            child.wait(10)
        if server is not None:
            server.stop()
    return 0


def _spawn_embedded_sidecar(settings: kvconfig.Settings) -> subprocess.Popen:
    """The monitor port(s) of a single-box controller, served by a sidecar child process."""
    cmd = [sys.executable, "-m", "kvlookup", "sidecar", "--redis-url", settings.redis_url,
           "--pull-url", f"{settings.host}:{settings.pull_port()}", "--log-level", settings.log_level]
    if settings.reply_port():
        cmd += ["--reply-url", f"{settings.host}:{settings.reply_port()}"]
    if settings.instance_ttl_s is not None:
        cmd += ["--instance-ttl", str(settings.instance_ttl_s)]
    log.info("embedded sidecar: %s", " ".join(cmd[3:]))
    return subprocess.Popen(cmd)


SIDECAR_SETTINGS = ("redis_url", "data_dir", "instance_ttl_s", "log_level", "instance_id", "pull_url",
                    "reply_url", "advertise_reply")


def cmd_sidecar(args: argparse.Namespace) -> int:
    from kvlookup.redis_server import connect
    from kvlookup.store import Store
    from sidecar.service import Sidecar

    settings = kvconfig.load(args.config, overrides=_overrides(args, SIDECAR_SETTINGS))
    setup_logging(settings.log_level)
    if not settings.pull_url and not settings.reply_url:
        raise ValueError("a sidecar needs --pull-url and/or --reply-url")
    server = ensure_redis(settings)
    store = Store(connect(settings.redis_url, socket_timeout=10), instance_ttl_s=settings.instance_ttl_s,
                  worker_ttl_s=settings.worker_ttl_s)
    sidecar = Sidecar(store, settings.pull_url, settings.reply_url,
                      instance_ids=(settings.instance_id,) if settings.instance_id else (),
                      advertise_reply=settings.advertise_reply)
    _stop_on_signals(sidecar.stop)
    log.info("sidecar: PULL %s, ROUTER %s, Redis %s", settings.pull_url, settings.reply_url, settings.redis_url)
    try:
        sidecar.run()
    finally:
        if server is not None:
            server.stop()
    return 0


def cmd_redis(args: argparse.Namespace) -> int:
    from kvlookup.redis_server import EmbeddedRedis, default_data_dir

    server = EmbeddedRedis(args.data_dir or default_data_dir(), args.port)
    print(server.start(), flush=True)
    stop = threading.Event()
    _stop_on_signals(stop.set)
    stop.wait()
    server.stop()
    return 0


def cmd_hash(args: argparse.Namespace) -> int:
    text = args.tokens.strip()
    tokens = json.loads(text) if text.startswith("[") else [int(t) for t in text.split(",") if t.strip()]
    settings = kvconfig.load(None, overrides=_overrides(args, ("lmcache_config",)))
    profile = settings.profile()
    for (start, end), h in zip(profile.chunk_bounds(len(tokens)), profile.chunk_hashes(tokens), strict=True):
        print(f"{start}\t{end}\t{h}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from kvlookup.demo import run_demo

    settings = kvconfig.load(None, overrides=_overrides(args, ("lmcache_config",)))
    return run_demo(args.pull_url, args.reply_url, args.http, args.era, settings.profile())


def cmd_quickstart(args: argparse.Namespace) -> int:
    from kvlookup.demo import quickstart

    return quickstart(args.port, args.monitor_port, args.data_dir)


def _stop_on_signals(stop) -> None:
    def handler(signum, _frame):
        log.info("signal %d: stopping", signum)
        stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
