#!/usr/bin/env bash
# Install kvlookup into .venv and run the seed walkthrough: an embedded Redis, a sidecar
# (LMCache controller_pull_url on localhost:9001) and the controller on localhost:9000, then a
# demo that sends LMCache worker messages for real Llama-3 prompts and shows the /lookup
# answers. Services keep running until Ctrl-C. No root, apt or Docker needed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh demo
exec .venv/bin/kvlookup quickstart "$@"
