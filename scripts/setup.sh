#!/usr/bin/env bash
# Create ./.venv and install epserve with its test dependencies. Idempotent.
# torch is installed first, by pip, pinned to 2.13.0: on a CPU host that is the wheel on local disk, so no
# multi-GB CUDA build is downloaded (not byte-compiled up front: the modules used compile on first import).
# The rest goes through uv (installed into the venv), which resolves and installs in seconds; it keeps
# the torch already there (pyproject allows up to 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
quiet() { "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  quiet .venv/bin/python -m pip install -q --no-compile "torch==2.13.0"
fi
.venv/bin/python -c "import uv" 2>/dev/null || quiet .venv/bin/python -m pip install -q uv
.venv/bin/python -m uv pip install -q --python .venv/bin/python -e ".[test]"
.venv/bin/python -c "import epserve, torch; print(f'epserve {epserve.__version__} on torch {torch.__version__}')"
