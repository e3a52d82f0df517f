#!/usr/bin/env bash
# Create ./.venv and install epserve with its test dependencies. Idempotent.
# torch is installed first and pinned to 2.13.0: on a CPU host that is the wheel on local disk,
# so no multi-GB CUDA build is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v '^WARNING: Location' || true
fi
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v '^WARNING: Location' || true
.venv/bin/python -c "import epserve, torch; print(f'epserve {epserve.__version__} on torch {torch.__version__}')"
