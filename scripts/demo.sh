#!/usr/bin/env bash
# Install kvlookup into .venv and run the seed walkthrough: an embedded Redis, a sidecar
# (LMCache controller_pull_url on localhost:9001) and the controller on localhost:9000, then a
# demo that sends LMCache worker messages for real Llama-3 prompts and shows the /lookup
# answers. Services keep running until Ctrl-C. No root, apt or Docker needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[demo]'
exec .venv/bin/kvlookup quickstart "$@"
