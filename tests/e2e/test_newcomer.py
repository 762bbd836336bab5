"""What a newcomer trips over first: bad settings named before anything starts, the bundled
redis-cli, ``reap --data-dir``, an old Python and a broken .venv, the demo's curl lines pasted as
printed, Ctrl-C without a traceback, sidecar metrics without the controller's, the files the
package promises (LICENSE, the docs' paths)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from kvlookup.cli.redis_cli import connection_flags
from kvlookup.devtools.demo import wait_http
from kvlookup.proc.redis_server import EmbeddedRedis, free_port
from tests.support.procs import ROOT, ControllerProc, SidecarProc

KVLOOKUP = [sys.executable, "-m", "kvlookup"]


def _kvlookup(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([*KVLOOKUP, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


# -- settings -------------------------------------------------------------------------------


@pytest.mark.parametrize(("how", "message"), [
    ({"env": {"KVLOOKUP_INSTANCE_TTL_S": "abc"}}, "instance_ttl_s: 'abc' is not a number"),
    ({"yaml": "port: [9000]\n"}, r"port: \[9000\] is not an integer"),
    ({"yaml": "instance_ttl_s: fast\n"}, "instance_ttl_s: 'fast' is not a number"),
    ({"yaml": "- port\n"}, "holds a list, not a mapping of settings"),
    ({"yaml": "port: [\n"}, "is not valid YAML"),
    ({"args": ["--port", "99999"]}, r"port: 99999 is not a TCP port \(1..65535\)"),
    ({"args": ["--monitor-ports", '{"pull": "x"}']}, r"""monitor_ports: '{"pull": "x"}' is not {"pull": P"""),
    ({"args": ["--monitor-ports", "{pull: 1}"]}, "monitor_ports: '{pull: 1}' is not JSON"),
    ({"env": {"KVLOOKUP_HASH__CHUNK_SIZE": "big"}}, "hash.chunk_size: 'big' is not an integer"),
    ({"env": {"KVLOOKUP_LOG_LEVEL": "loud"}}, "log_level: 'loud' is not one of DEBUG, INFO"),
])
def test_a_bad_value_is_named_before_anything_starts(tmp_path, how, message):
    args = list(how.get("args", []))
    if "yaml" in how:
        (tmp_path / "c.yaml").write_text(how["yaml"])
        args += ["--config", str(tmp_path / "c.yaml")]
    if "--port" not in args and "yaml" not in how:
        args += ["--port", str(free_port())]
    data = tmp_path / "data"
    done = _kvlookup("controller", "--data-dir", str(data), *args, env=how.get("env"), timeout=20)
    assert done.returncode == 2 and done.stderr.startswith("kvlookup: error: "), done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert "Traceback" not in done.stderr and not data.exists()  # no embedded Redis was started


def test_env_hash_settings_are_typed():
    from kvlookup.config import load

    settings = load(None, env={"KVLOOKUP_HASH__CHUNK_SIZE": "512", "KVLOOKUP_MONITOR_PORTS": '{"pull": 9001}'})
    assert (settings.profile().chunk_size, settings.pull_port()) == (512, 9001)
    with pytest.raises(ValueError, match="hash.chunksize: unknown hash setting"):
        load(None, env={"KVLOOKUP_HASH__CHUNKSIZE": "512"})


# -- redis-cli and reap on the embedded Redis ----------------------------------------------


def test_redis_cli_opens_the_bundled_cli_on_the_data_dirs_server(redis_server):
    done = _kvlookup("redis-cli", "--data-dir", str(redis_server.data_dir), "ping")
    assert (done.returncode, done.stdout.strip()) == (0, "PONG"), done.stderr
    done = _kvlookup("redis-cli", "--data-dir", str(redis_server.data_dir), "--", "--raw", "echo", "hi")
    assert done.stdout.strip() == "hi", done.stderr


def test_redis_cli_on_a_url_with_cluster_redirections(redis_url, redis_args):
    done = _kvlookup("redis-cli", *redis_args, "set", "newcomer:k", "v")
    assert done.stdout.strip() == "OK", done.stderr
    assert _kvlookup("redis-cli", *redis_args, "get", "newcomer:k").stdout.strip() == "v"


def test_redis_cli_passes_a_password_outside_the_command_line(tmp_path):
    server = EmbeddedRedis(tmp_path / "pw", appendonly=False, password="s3cret")
    url = server.start()
    try:
        flags, password = connection_flags(url)
        assert password == "s3cret" and "s3cret" not in " ".join(flags)
        done = _kvlookup("redis-cli", "--redis-url", url, "ping")
        assert done.stdout.strip() == "PONG" and "password" not in done.stderr.lower(), done.stderr
    finally:
        server.stop()


def test_redis_cli_flags_for_each_url_kind():
    flags = ["-h", "h", "-p", "7000", "-n", "3", "--user", "u"]
    assert connection_flags("redis://u:p%40ss@h:7000/3") == (flags, "p@ss")
    assert connection_flags("unix:///run/r.sock?db=2") == (["-s", "/run/r.sock", "-n", "2"], None)
    assert connection_flags("rediss://h/0")[0][:5] == ["-h", "h", "-p", "6379", "--tls"]
    with pytest.raises(ValueError, match="redis_url: 'http://h' is not a redis://"):
        connection_flags("http://h")


def test_reap_and_redis_cli_take_the_data_dir(tmp_path, redis_server):
    done = _kvlookup("reap", "--data-dir", str(redis_server.data_dir))
    assert done.returncode == 0 and json.loads(done.stdout) == {"reaped": [], "purged": 0}, done.stderr
    for cmd in ("reap", "redis-cli"):
        done = _kvlookup(cmd, "--data-dir", str(tmp_path / "none"))
        assert done.returncode == 2, done
        assert f"no embedded Redis is running for data dir {tmp_path / 'none'}" in done.stderr
    assert "--data-dir" in _kvlookup("reap", "--help").stdout


# -- scripts/venv.sh ------------------------------------------------------------------------


def _fake_python(path: Path, version: str, log: Path) -> Path:
    """A stand-in interpreter: answers the version check as ``version``, logs every call, and
    ``-m venv DIR`` makes DIR/bin/python a good 3.11 stand-in."""
    ok = tuple(int(x) for x in version.split(".")[:2]) >= (3, 11)
    path.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        echo "$0 $*" >> {log}
        case "$1" in
          -c) exit {0 if ok else 1} ;;
          -V) echo "Python {version}" ;;
          -m) if [ "$2" = venv ]; then mkdir -p "$3/bin"; cp "{path.parent / 'good'}" "$3/bin/python"; fi ;;
        esac
        """))
    path.chmod(0o755)
    return path


def _venv_sh(work: Path, python: Path) -> subprocess.CompletedProcess:
    (work / "scripts").mkdir(exist_ok=True)
    shutil.copy(ROOT / "scripts" / "venv.sh", work / "scripts" / "venv.sh")
    (work / "pyproject.toml").touch()
    return subprocess.run(["bash", "-c", "set -euo pipefail; . scripts/venv.sh test"], cwd=work,
                          capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHON": str(python)})


def test_venv_sh_refuses_an_old_python_with_one_message(tmp_path):
    log = tmp_path / "calls.log"
    done = _venv_sh(tmp_path, _fake_python(tmp_path / "python3.10", "3.10.13", log))
    assert done.returncode == 1
    assert "kvlookup needs Python 3.11 or newer" in done.stderr and "Python 3.10.13" in done.stderr
    assert "PYTHON=python3.11" in done.stderr and len(done.stderr.strip().splitlines()) == 2
    assert not (tmp_path / ".venv").exists()


@pytest.mark.parametrize("broken", ["old", "dangling"])
def test_venv_sh_rebuilds_a_venv_that_is_too_old_or_broken(tmp_path, broken):
    log = tmp_path / "calls.log"
    _fake_python(tmp_path / "good", "3.11.9", log)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    stale = tmp_path / ".venv" / "bin" / "python"
    if broken == "old":
        _fake_python(stale, "3.10.13", log)
    else:
        stale.symlink_to(tmp_path / "removed-interpreter")
    done = _venv_sh(tmp_path, tmp_path / "good")
    assert done.returncode == 0, done.stderr
    assert "building it again" in done.stderr
    calls = log.read_text()
    assert " -m venv .venv" in calls and "-m pip install -q -e .[test]" in calls
    assert (tmp_path / ".venv" / ".kvlookup-installed-test").exists()


# -- the demo's curl lines ------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_demo_prints_curl_lines_that_run_as_pasted(redis_args, capsys):
    from kvlookup.devtools.demo import start_engines
    from kvlookup.hashing.lmcache import HashProfile

    pull = free_port()
    ctrl = ControllerProc(*redis_args, "--monitor-port", str(pull)).wait_ready()
    engines = []
    try:
        engines = start_engines(f"127.0.0.1:{pull}", None, ctrl.http, "0.3", HashProfile())
        out = capsys.readouterr().out.splitlines()
        runs = [(line[2:], out[i + 1]) for i, line in enumerate(out) if line.startswith("$ curl ")]
        assert len(runs) >= 2 and all("..." not in cmd for cmd, _ in runs)
        for cmd, printed in runs:
            got = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=10, cwd="/")
            answer, want = json.loads(got.stdout), json.loads(printed)
            answer.pop("event_id"), want.pop("event_id")
            assert answer == want and answer, (cmd, got.stderr)
        assert any(" -d @" in cmd for cmd, _ in runs)  # the long prompts come from files
    finally:
        for e in engines:
            e.close()
        ctrl.stop()


# -- Ctrl-C ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_ctrl_c_stops_the_controller_without_a_traceback(tmp_path):
    """Ctrl-C signals the whole process group: master, gunicorn workers, the embedded sidecar."""
    port, pull = free_port(), free_port()
    for attempt in range(2):
        proc = subprocess.Popen([*KVLOOKUP, "controller", "--port", str(port), "--monitor-port", str(pull),
                                 "--data-dir", str(tmp_path / "data")], cwd=ROOT, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        http = f"http://127.0.0.1:{port}"
        assert wait_http(http, timeout=30, proc=proc), "the controller did not come up"
        urllib.request.urlopen(http + "/metrics", timeout=5).read()
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0, out[-3000:]
        assert "Traceback" not in out and "SystemExit" not in out, f"attempt {attempt}:\n{out[-3000:]}"
        assert "None" not in out, out  # startup lines name absent endpoints as "-"


# -- metrics --------------------------------------------------------------------------------


def test_a_standalone_sidecar_serves_no_lookup_metrics(redis_args, redis_url):
    sc = SidecarProc(*redis_args, pull_url=f"127.0.0.1:{free_port()}").start()
    try:
        text = sc.metrics()
    finally:
        sc.stop()
    assert "kvlookup_ingest_ops_total" in text
    assert "kvlookup_lookup" not in text  # kvlookup_lookups_total, _lookup_seconds, _lookup_matched_tokens


def test_the_controller_serves_the_lookup_metrics(redis_args):
    ctrl = ControllerProc(*redis_args, "--monitor-port", str(free_port())).wait_ready()
    try:
        ctrl.lookup([1, 2, 3])
        deadline = time.monotonic() + 5
        text = ""
        while "kvlookup_lookups_total{" not in text and time.monotonic() < deadline:
            text = ctrl.session.get(ctrl.http + "/metrics", timeout=5).text
    finally:
        ctrl.stop()
    assert 'kvlookup_lookups_total{outcome="miss"} 1.0' in text
    assert "kvlookup_lookup_seconds_count" in text and "kvlookup_lookup_matched_tokens_bucket" in text


# -- files ----------------------------------------------------------------------------------


def test_the_license_file_is_the_apache_2_0_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()


@pytest.mark.parametrize("doc", ["benchmarks.md", "benchmarks-notes.md", "operations.md", "configuration.md"])
def test_paths_named_in_the_docs_exist(doc):
    text = (ROOT / "docs" / doc).read_text()
    named = set(re.findall(r"`((?:\.\./shared|bench|docs|tests|scripts|kvlookup|app|sidecar|config|/work)"
                           r"/[\w./-]+)`", text))
    missing = [p for p in named if not (ROOT / p).exists() and not Path(p).exists()]
    assert missing == [], missing


def test_shlex_quoted_bodies_survive_bash():
    from kvlookup.devtools.demo import curl_command

    cmd = curl_command("http://x", "seed", [1, 2])
    assert shlex.split(cmd)[-1] == '{"tokens": [1, 2]}'


def test_compose_advertises_an_address_host_engines_can_reach():
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, controller in (("sidecar", "controller"), ("cluster-sidecar", "cluster-controller")):
        service = compose["services"][name]
        assert "--advertise-reply" not in service["command"]  # the environment decides
        default = re.fullmatch(r"\$\{\w+:-([^}]*)\}", service["environment"]["KVLOOKUP_ADVERTISE_REPLY"]).group(1)
        published = {p.rsplit(":", 1)[0] for p in service["ports"]}  # "127.0.0.1:9002" of "127.0.0.1:9002:9002"
        assert default in published, (name, default, published)
        assert compose["services"][controller]["extra_hosts"] == ["host.docker.internal:host-gateway"]
    readme = (ROOT / "README.md").read_text()
    assert "## Docker Compose" in readme and "KVLOOKUP_ADVERTISE_REPLY=sidecar:9002" in readme


def test_the_demo_engines_stay_indexed_while_it_runs(redis_args, capsys):
    """The demo's simulated engines answer the controller's health calls and stay registered, so
    its curl lines and the dashboard keep their answers (they used to be probed, found silent and
    reaped ~10 s after the demo printed)."""
    from kvlookup.devtools.demo import start_engines
    from kvlookup.hashing.lmcache import HashProfile
    from tests.conftest import SEED_TOKENS

    pull = free_port()
    ctrl = ControllerProc(*redis_args, "--monitor-port", str(pull)).wait_ready()
    engines = []
    try:
        engines = start_engines(f"127.0.0.1:{pull}", None, ctrl.http, "0.3", HashProfile())
        want = {"lmcache_default_instance": ["LocalCPUBackend", 12]}
        assert ctrl.layout(SEED_TOKENS) == want
        time.sleep(15)  # past the liveness probe's first rounds
        assert ctrl.layout(SEED_TOKENS) == want
        assert sum(e.health_calls for e in engines) >= 1  # they were asked, and answered
    finally:
        for e in engines:
            e.close()
        ctrl.stop()


def test_the_demo_says_when_the_sidecar_stored_nothing(redis_args, capsys):
    """A sidecar that accepts only pod-a and pod-b (allowed_instance_ids, README step 2): the demo's
    default engines are dropped there, and the demo says so on stderr instead of only printing
    "Stored"; named with --instance-ids (start_engines' instances) they are stored and answered."""
    from kvlookup.devtools.demo import start_engines
    from kvlookup.hashing.lmcache import HashProfile

    pull = free_port()
    ctrl = ControllerProc(*redis_args, "--monitor-port", str(free_port())).wait_ready()
    sidecar = SidecarProc(*redis_args, "--allowed-instance-ids", "pod-a,pod-b",
                          pull_url=f"127.0.0.1:{pull}").start()
    engines = []
    try:
        engines = start_engines(f"127.0.0.1:{pull}", None, ctrl.http, "0.3", HashProfile())
        err = capsys.readouterr().err
        assert "names no 'lmcache_default_instance' for the seed prompt" in err and "--instance-ids" in err
        for e in engines:
            e.close()
        engines = start_engines(f"127.0.0.1:{pull}", None, ctrl.http, "0.3", HashProfile(), ("pod-a", "pod-b"))
        out = capsys.readouterr()
        assert "names no" not in out.err and '"pod-a":["LocalCPUBackend",12]' in out.out
    finally:
        for e in engines:
            e.close()
        sidecar.kill()
        ctrl.stop()
