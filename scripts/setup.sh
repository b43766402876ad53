#!/usr/bin/env bash
# Set up hyperloom in a virtual environment (.venv) on a fresh machine.
#   HYPERLOOM_TORCH  the torch requirement to install first (default: torch==2.13.0, the CPU
#                    build this project's CI machines carry; on a GPU machine use the build
#                    for your accelerator, e.g. HYPERLOOM_TORCH="torch>=2.6").
set -euo pipefail
cd "$(dirname "$0")/.."
# pip warns once per missing local mirror folder; those lines say nothing about this project.
quiet_pip() { pip install --quiet "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating virtual environment .venv"
  "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing ${HYPERLOOM_TORCH:-torch==2.13.0}"
  quiet_pip "${HYPERLOOM_TORCH:-torch==2.13.0}"
fi
echo "[setup] installing hyperloom and its test / Hugging Face extras"
quiet_pip -e ".[test,hf]"
python -c "import hyperloom, torch; print(f'[setup] hyperloom {hyperloom.__version__}, torch {torch.__version__}')"
