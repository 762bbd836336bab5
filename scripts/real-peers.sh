#!/usr/bin/env bash
# Build the real peers the compatibility tests drive (idempotent; skips what exists). Everything
# it runs is in this repository (tests/compat/); it needs the package index and nothing beside the clone.
#   .venv-lmcache  LMCache 0.5.6 on CPU torch 2.13.0 (runs tests/compat/lmcache_driver.py)
#   .venv-vllm     the pure-Python deps of vLLM's KV-event publisher (no torch: the driver stubs it)
#   .vllmsrc       vLLM sources 0.10.2 0.11.0 0.25.1 0.26.0 0.33.0 (sdists checked against pinned
#                  sha256 by tests/compat/fetch_vllm.py)
# Set KVLOOKUP_LMCACHE_VERSION=0.5.7 to build the LMCache venv on another release.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LMCACHE_VERSION=${KVLOOKUP_LMCACHE_VERSION:-0.5.6}
VLLM_VERSIONS=(0.10.2 0.11.0 0.25.1 0.26.0 0.33.0)
if [ ! -x .venv-lmcache/bin/lmcache_controller ]; then
  echo "real-peers: building .venv-lmcache (torch 2.13.0 CPU, lmcache $LMCACHE_VERSION)" >&2
  "$PY" -m venv .venv-lmcache
  .venv-lmcache/bin/python -m pip install -q --upgrade pip
  .venv-lmcache/bin/python -m pip install -q torch==2.13.0      # CPU build first, or pip pulls CUDA torch
  .venv-lmcache/bin/python -m pip install -q "lmcache==$LMCACHE_VERSION" pyzmq msgpack  # 0.5.7 no longer pulls pyzmq
fi
if [ ! -x .venv-vllm/bin/python ] || ! .venv-vllm/bin/python -c "import msgspec, zmq, cbor2" 2>/dev/null; then
  echo "real-peers: building .venv-vllm (vLLM publisher deps, no torch)" >&2
  "$PY" -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q msgspec pyzmq msgpack pydantic regex typing_extensions psutil \
    urllib3 cbor2 xxhash numpy cachetools cloudpickle packaging setproctitle pyyaml
fi
need=()
for v in "${VLLM_VERSIONS[@]}"; do [ -f ".vllmsrc/x/vllm-$v/vllm/distributed/kv_events.py" ] || need+=("$v"); done
if [ "${#need[@]}" -gt 0 ]; then
  "$PY" tests/compat/fetch_vllm.py --dest .vllmsrc "${need[@]}"
fi
echo "real-peers: ready (.venv-lmcache, .venv-vllm, .vllmsrc)" >&2
