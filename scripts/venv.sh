#!/usr/bin/env bash
# Sourced by scripts/demo.sh and scripts/test.sh: make .venv (Python >= 3.11, $PYTHON or
# python3) and install kvlookup in it, editable, with the extras named in $1 (e.g. "test").
# An interpreter older than 3.11 stops here with one message saying how to pick another; a
# .venv whose Python is too old or broken (a removed interpreter, no pip) is built again.
# The install is skipped when pyproject.toml, setup.py and the C extension's source have not
# changed since the last one for $1 and the extension is there where a C compiler is (the
# editable install builds kvlookup._native in place; setup.py).
PY=${PYTHON:-python3}
# py_ok PYTHON: it runs, and it is Python 3.11 or newer
py_ok() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; }
if ! py_ok "$PY"; then
  found=$("$PY" -V 2>&1 | head -n 1) || found="not found"
  echo "kvlookup needs Python 3.11 or newer; $PY is ${found:-not found}." >&2
  echo "Pick another interpreter with PYTHON, e.g.: PYTHON=python3.11 bash $0" >&2
  exit 1
fi
# py_version PYTHON: "3.12" (major.minor)
py_version() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
if [ -n "${PYTHON:-}" ] && [ -x .venv/bin/python ] && [ "$(py_version "$PY")" != "$(py_version .venv/bin/python)" ]; then
  echo "kvlookup: .venv has Python $(py_version .venv/bin/python), PYTHON=$PY is $(py_version "$PY"): building it again" >&2
  rm -rf .venv
fi
if [ -e .venv ] && ! { py_ok .venv/bin/python && .venv/bin/python -m pip --version >/dev/null 2>&1; }; then
  echo "kvlookup: .venv has no working Python 3.11+ (too old or broken); building it again with $PY" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.kvlookup-installed-$1"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ] \
    || [ kvlookup/_native.c -nt "$stamp" ] \
    || { command -v "${CC:-cc}" >/dev/null && ! compgen -G "kvlookup/_native*.so" >/dev/null; }; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[$1]"
  touch "$stamp"
fi
