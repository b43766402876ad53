#!/usr/bin/env bash
# Fresh machine -> the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check hyperloom tests benchmarks
python -m pytest tests -q "$@"
