#!/usr/bin/env bash
# Train the default job with two git revisions of hyperloom, interleaved, and print tokens/s
# and the final validation loss of each run: a refactor should leave both where they were.
#   bash benchmarks/compare_revisions.sh REV_A REV_B [ROUNDS] [-- extra train overrides]
# Each revision's package is exported to a temporary folder and run from there, so the
# checkout itself is not touched. Results go to benchmarks/results/compare_revisions.json.
set -euo pipefail
cd "$(dirname "$0")/.."
a=$1 b=$2 rounds=${3:-2}
shift $(( $# >= 3 ? 3 : 2 ))
[ "${1:-}" = "--" ] && shift
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for rev in "$a" "$b"; do
  mkdir -p "$work/$rev" && git archive "$rev" hyperloom | tar -x -C "$work/$rev"
done
args=(--train.steps 150 --logging.log_every 50 --logging.self_check off
      --logging.sample_tokens 0 --logging.plot false --logging.progress false
      --train.eval_every 0 --train.eval_batches 2 "$@")
rows=()
for round in $(seq "$rounds"); do
  for rev in "$a" "$b"; do
    run="$work/run_${rev}_$round"
    if ! (cd "$work/$rev" && python3 -m hyperloom train "${args[@]}" --run-dir "$run" >"$run.log" 2>&1); then
      echo "revision $rev failed:" >&2; tail -5 "$run.log" >&2; exit 1
    fi
    row=$(python3 -c "import json,sys; s=json.load(open('$run/summary.json')); \
print(json.dumps({'rev': '$rev', 'round': $round, 'tokens_per_s': s['tokens_per_s'], \
'final_val_loss': s['final_val_loss'], 'device': s['device']}))")
    echo "$row"
    rows+=("$row")
  done
done
printf '%s\n' "${rows[@]}" | python3 -c "import json,sys; \
json.dump([json.loads(l) for l in sys.stdin], open('benchmarks/results/compare_revisions.json','w'), indent=1)"
