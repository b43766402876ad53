#!/usr/bin/env bash
# Fresh machine -> trained default model + a generated sample. Extra arguments go to
# `hyperloom train` (e.g. --train.steps 50).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
hyperloom train configs/quickstart.toml "$@"
