#!/usr/bin/env bash
# Create ./.venv and install epserve with its test dependencies. Idempotent.
# torch is installed first, by pip, pinned to 2.13.0: on a CPU host that is the wheel on local disk, so no
# multi-GB CUDA build is downloaded; it and its dependencies are byte-compiled by compileall on every core
# (faster than pip's one-core pass; rank processes import them, and no process writes bytecode where
# PYTHONDONTWRITEBYTECODE is set: sympy, which torch.compile and the CPU graph's recording import, cost every
# such process about 1.5 s of compiling its 500 modules from source). The rest goes through uv (installed into
# the venv), which resolves, downloads and compiles in parallel; it keeps the torch already there (pyproject
# allows up to 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
quiet() { "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  quiet .venv/bin/python -m pip install -q --no-compile "torch==2.13.0"
  SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  .venv/bin/python -m compileall -q -j 0 "$SITE" > /dev/null || true  # torch and what pip brought with it (sympy)
fi
.venv/bin/python -c "import uv" 2>/dev/null || quiet .venv/bin/python -m pip install -q uv
.venv/bin/python -m uv pip install -q --compile-bytecode --python .venv/bin/python -e ".[test]"
.venv/bin/python -m compileall -q -j 0 src > /dev/null || true  # the editable source too, for the same reason
.venv/bin/python -c "import epserve, torch; print(f'epserve {epserve.__version__} on torch {torch.__version__}')"
