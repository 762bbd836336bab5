#!/usr/bin/env bash
# Sourced by scripts/demo.sh and scripts/test.sh: make .venv (Python >= 3.11, $PYTHON or
# python3) and install kvlookup in it, editable, with the extras named in $1 (e.g. "test").
# The install is skipped when pyproject.toml has not changed since the last one for $1.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.kvlookup-installed-$1"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$1]"
  touch "$stamp"
fi
