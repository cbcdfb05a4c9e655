#!/usr/bin/env bash
# What the suite needs beyond pip, installed when missing: Debian's Chromium (the dashboard's browser test) and
# the npm packages of the Node.js interoperability test (tests/interop). Safe to run again; any failure stops
# the test command here, loudly, instead of letting a test find the piece missing.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v chromium >/dev/null 2>&1; then
  echo "installing Debian's chromium for the dashboard's browser test"
  as_root=()
  [ "$(id -u)" = 0 ] || as_root=(sudo -n)
  export DEBIAN_FRONTEND=noninteractive
  "${as_root[@]}" apt-get install -y -q chromium >/dev/null \
    || { "${as_root[@]}" apt-get update -q >/dev/null && "${as_root[@]}" apt-get install -y -q chromium >/dev/null; }
fi

if [ -f tests/interop/package-lock.json ]; then
  command -v npm >/dev/null 2>&1 || { echo "npm is missing: install Node.js 20 and npm (apt-get install nodejs npm)" >&2; exit 1; }
  npm ci --prefix tests/interop --no-audit --no-fund --loglevel=error
fi

# Bytecode for the project's own modules: with PYTHONDONTWRITEBYTECODE set (CI images often set it) every CLI
# subprocess a test starts would compile them again, about 0.16 s of CPU a command.
"${PYTHON:-.venv/bin/python}" -m compileall -q -j 0 bus observers mesh epibus
