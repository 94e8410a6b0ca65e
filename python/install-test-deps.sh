#!/usr/bin/env sh
# Installs what python/tests and the package's lint need (python/requirements-test.txt: torch, diffusers, transformers,
# numpy, pytest, maturin, ruff, mypy) into the git-ignored virtualenv .venv-py/ at the repository root; a few seconds
# when they are already there.
# torch has no CPU-only wheel on PyPI for Linux x86_64: the first install downloads about 2.6 GB. On a machine without
# a GPU, put PyTorch's CPU build into .venv-py/ first and it is kept (torch==2.11.0 accepts 2.11.0+cpu; docs/python.md):
#   python3 -m venv .venv-py && .venv-py/bin/pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cpu
# Usage (from anywhere): sh python/install-test-deps.sh   (PYTHON=python3.X picks the interpreter, >= 3.9)
set -eu
cd "$(dirname "$0")/.."
if [ ! -x .venv-py/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv-py
fi
.venv-py/bin/python -m pip install --quiet --disable-pip-version-check --no-cache-dir -r python/requirements-test.txt
