#!/bin/sh
# specpolicy helper, session 8 (issue 15): the adaptive policy at batch 32/64 on the 8B shape's
# controlled-acceptance pair (EPS 0.023113, per-token acceptance ~0.71-0.73), interleaved off /
# adaptive / fixed k = 4 (tools/gpu/spec8b/run.sh's draft64 part), with PD_SPEC_STATS (the draft's
# steady and transient forwards, first forwards of each draft shape, the old all-forwards EMA).
# Run from build/gpu-specpolicy/ of the lead's checkout: pdserve (this branch, stripped),
# optionally pdserve.before (the spec8b binary, for a same-machine baseline), lib/ (= /work/devlibs/lib),
# models/l8b. Env: BUDGET (seconds for the whole script), BEFORE=1 to also run pdserve.before.
set -u
out=$1; mkdir -p "$out"
cd "$(dirname "$0")"
nvidia-smi 2>/dev/null --query-gpu=name,memory.total --format=csv,noheader
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PD_SPEC_STATS=1
t0=$(date +%s)
M=models/l8b
ARGS="--device cuda --model $M --load-format dummy --speculative-method draft --speculative-model $M
  --speculative-dummy-layers 1 --dummy-residual-scale 1:${EPS:-0.023113} --random-prompt 32 --random-prompts 8
  --num-speculative-tokens 4 --max-tokens 64 --batches ${BATCHES:-32,64} --reps ${REPS:-3} --modes ${MODES:-off,adaptive,fixed}"
left() { echo $(( ${BUDGET:-60} - ($(date +%s) - t0) )); }
run() {  # name, binary, limit
  n=$1; bin=$2; lim=$3
  [ "$(left)" -lt "$lim" ] && lim=$(left)
  [ "$lim" -lt 10 ] && { echo "== $n skipped: budget spent"; return 1; }
  # shellcheck disable=SC2086
  timeout "$lim" ./$bin bench-spec $ARGS --json "$out/$n.json" > "$out/$n.txt" 2> "$out/$n.err"; rc=$?
  echo "== $n rc=$rc ($(( $(date +%s) - t0 )) s)"
  grep -E "ready in|batch=|summary" "$out/$n.txt" | cut -c1-200
  grep -E "spec stats: ([0-9]+ (draft|steps)|draft forwards:|draft shape|first draft|transient|shape batch 64)" "$out/$n.err" |
    sed 's/.*spec stats: //' | cut -c1-220 | head -${LINES_MAX:-80}
  [ $rc = 0 ] || tail -3 "$out/$n.err"
  return $rc
}
run after pdserve 45
[ "${BEFORE:-0}" = 1 ] && [ -x pdserve.before ] && run before pdserve.before 40
echo "total $(( $(date +%s) - t0 )) s"
