#!/usr/bin/env bash
# Sourced by scripts/demo.sh and scripts/test.sh: make .venv (Python >= 3.11, $PYTHON or
# python3) and install kvlookup in it, editable, with the extras named in $1 (e.g. "test").
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[$1]"
