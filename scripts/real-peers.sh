#!/usr/bin/env bash
# Build the real peers the compatibility tests drive (idempotent; skips what exists):
#   .venv-lmcache  LMCache 0.5.6 on CPU torch 2.13.0 (runs ../shared/tools/lmcache_real_client.py)
#   .venv-lmcache057  LMCache 0.5.7rc2 on CPU torch 2.13.0, with pyzmq (the MP tests: KVLOOKUP_LMCACHE057_PYTHON)
#   .venv-vllm     the pure-Python deps of vLLM's KV-event publisher (no torch: --stub-torch)
#   .vllmsrc       vLLM sources 0.10.2 0.11.0 0.25.1 0.26.0 0.33.0 (sha256-checked sdists)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SHARED=${KVLOOKUP_SHARED:-../shared}
if [ ! -f "$SHARED/tools/vllm_real_publisher.py" ] || [ ! -f "$SHARED/tools/lmcache_real_client.py" ]; then
  echo "real-peers: $SHARED/tools is missing; the peer harnesses live in the reference folder ../shared" >&2
  echo "            (set KVLOOKUP_SHARED=/path/to/shared)" >&2
  exit 2
fi
if [ ! -x .venv-lmcache/bin/lmcache_controller ]; then
  "$PY" -m venv .venv-lmcache
  .venv-lmcache/bin/python -m pip install -q --upgrade pip
  .venv-lmcache/bin/python -m pip install -q torch==2.13.0      # CPU build first, or pip pulls CUDA torch
  .venv-lmcache/bin/python -m pip install -q lmcache==0.5.6
fi
if [ ! -x .venv-lmcache057/bin/python ] || ! .venv-lmcache057/bin/python -c "import lmcache, zmq" 2>/dev/null; then
  "$PY" -m venv .venv-lmcache057
  .venv-lmcache057/bin/python -m pip install -q --upgrade pip
  .venv-lmcache057/bin/python -m pip install -q torch==2.13.0
  .venv-lmcache057/bin/python -m pip install -q lmcache==0.5.7rc2 pyzmq  # 0.5.7 no longer pulls pyzmq in
fi
if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import msgspec, zmq, cbor2" 2>/dev/null; then
  "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q msgspec pyzmq msgpack pydantic regex typing_extensions psutil \
    urllib3 cbor2 xxhash numpy cachetools cloudpickle packaging setproctitle pyyaml
fi
need=0
for v in 0.10.2 0.11.0 0.25.1 0.26.0 0.33.0; do [ -d ".vllmsrc/x/vllm-$v" ] || need=1; done
if [ "$need" = 1 ]; then
  args=(); for v in 0.10.2 0.11.0 0.25.1 0.26.0 0.33.0; do args+=(--version "$v"); done
  .venv-vllm/bin/python "$SHARED/tools/vllm_real_publisher.py" --stub-torch fetch --dest .vllmsrc "${args[@]}"
fi
