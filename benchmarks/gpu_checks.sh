#!/usr/bin/env bash
# The GPU checks of the open issues, as one prepared run for a session that is lent a GPU.
#
#   FP8 (issue 5):   one GEMM at 8192^3 in BF16 and FP8 per recipe (target: FP8 >= 1.5x BF16),
#                    and a training step of a 4-layer Llama-3-8B-shaped stack (target >= 1.25x);
#   fused ops (6):   every operator at the issue's shapes (8 x 1024 tokens, hidden 4096, vocab
#                    128k), with the hand-written Triton kernels timed beside torch.compile's.
#
# Each check has its own time limit and the run goes on past a failed one; logs and JSON go to
# $OUT (default benchmarks/results/gpu) and a summary of return codes ends the run. The limits
# (120 + 210 + 240 s) keep the whole run inside one 10-minute device call; it has not yet run
# on a GPU, so how long each check takes there is not known.
#
# A machine whose Python has PyTorch with CUDA but not hyperloom's own dependencies: the run
# puts the repository on PYTHONPATH, and installs wheels from .whl/ when that folder exists
# (a pure-Python dependency such as tomli-w can be fetched beforehand on a machine with
# internet: `pip download --no-deps -d .whl tomli-w`; keep .whl/ out of git and send it along
# with the working tree). Without them the run stops at once and says what is missing.
#
#   bash benchmarks/gpu_checks.sh              # OUT=... to choose where results go
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/hyperloom_site .whl/*.whl
  export PYTHONPATH="/tmp/hyperloom_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! missing=$("$PY" -c "import hyperloom.config" 2>&1); then
  echo "hyperloom does not import with $PY: ${missing##*$'\n'}" | tee "$OUT/device.txt"
  echo "put the missing packages' wheels in .whl/ (see this script's header) and run again"
  exit 2
fi
"$PY" - <<'EOF' 2>&1 | tee "$OUT/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name())
import hyperloom
print("hyperloom", hyperloom.__version__)
EOF

declare -A RC
check() {  # check NAME SECONDS COMMAND...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  (cd benchmarks && timeout "$limit" "$@") 2>&1 | tee "$OUT/$name.log"
  RC[$name]=${PIPESTATUS[0]}
  echo "== $name: rc ${RC[$name]} after $((SECONDS - t0)) s"
}

check fp8_gemm 120 "$PY" fp8_gemm.py --device cuda --shapes 8192x8192x8192,4096x4096x4096 \
  --repeats 10 --json "$OUT/fp8_gemm_cuda.json"
check fp8_layer_stack 210 "$PY" fp8_layer_stack.py --device cuda --layers 4 --tokens 8192 \
  --seq-len 4096 --warmup 3 --steps 10 --json "$OUT/fp8_layer_stack_cuda.json"
check fused_ops 240 "$PY" fused_ops.py --device cuda --tokens 8192 --ce-tokens 8192 \
  --e2e-rounds 0 --json "$OUT/fused_ops_cuda.json"

echo "== summary (return codes; 124 = time limit)"
for name in fp8_gemm fp8_layer_stack fused_ops; do echo "  $name: ${RC[$name]}"; done
