#!/bin/sh
# spec8b helper, session 8 (issue 15): an end-to-end single-stream speedup at a controlled
# acceptance on the Llama-3-8B shape (docs/benchmarks.md "a controlled-acceptance fixture").
# Target: models/l8b (bench/configs/llama-3-8b + the kjv tokenizer), dummy weights, layers 1..31
# writing into the residual stream scaled by EPS (--dummy-residual-scale 1:EPS); draft: the same
# folder cut to its first layer with the target's seed (--speculative-dummy-layers 1).
# Run from build/gpu-spec8b/ of the lead's checkout: stripped pdserve, lib/ (= /work/devlibs/lib),
# models/l8b. Parts (env PARTS): sweep (per-token acceptance vs EPS at k = 1, batch 8), main (the
# interleaved comparison at the EPS interpolated for acceptance TARGET_A, or EPS if set), l8b64
# (ngram / lookahead adaptive vs off at batch 32, 64), eps2 (more EPS:K points at batch 1), draft64
# (the draft fixture at batch 32, 64). Logs come back as all.tar.xz.
set -u
out=$1; mkdir -p "$out"
cd "$(dirname "$0")"
nvidia-smi 2>/dev/null --query-gpu=name,memory.total --format=csv,noheader
export LD_LIBRARY_PATH="$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" PD_SPEC_STATS=1
t0=$(date +%s)
M=${MODEL:-models/l8b}
FIX="--model $M --load-format dummy --speculative-method draft --speculative-model $M --speculative-dummy-layers 1"
W="--random-prompt 32 --random-prompts 8"
left() { echo $(( ${BUDGET:-95} - ($(date +%s) - t0) )); }  # seconds left of this call's budget
run() {  # name, limit, args... (the limit shrinks to what is left of BUDGET)
  n=$1; lim=$2; shift 2
  [ "$(left)" -lt "$lim" ] && lim=$(left)
  [ "$lim" -lt 5 ] && { echo "== $n skipped: budget spent"; return 1; }
  timeout "$lim" ./pdserve bench-spec --device ${DEVICE:-cuda} "$@" --json "$out/$n.json" > "$out/$n.txt" 2> "$out/$n.err"; rc=$?
  echo "== $n rc=$rc ($(( $(date +%s) - t0 )) s)"
  grep -E "ready in|batch=|summary|workload" "$out/$n.txt" | cut -c1-220
  grep -E "spec stats: [0-9]+ (draft|steps)|spec stats: shape" "$out/$n.err" | sed 's/.*spec stats: //' | cut -c1-200
  [ $rc = 0 ] || tail -3 "$out/$n.err"
  return $rc
}
PARTS=${PARTS:-sweep main}
case " $PARTS " in *" sweep "*)
  : > "$out/sweep.tsv"
  for e in ${SWEEP:-0 0.003 0.01 0.03 0.1}; do
    run sweep_$e 20 $FIX --dummy-residual-scale 1:$e $W --num-speculative-tokens 1 --max-tokens 48 --batches 8 --reps 1 --modes off,fixed
    a=$(awk '/fixed +batch=8/ { for (i = 1; i < NF; i++) if ($i == "acceptance") print $(i + 1) }' "$out/sweep_$e.txt")
    [ -n "$a" ] && printf '%s\t%s\n' "$e" "$a" >> "$out/sweep.tsv"
  done
  cat "$out/sweep.tsv";;
esac
# EPS for acceptance A: log-linear between the sweep's bracketing points (acceptance falls with EPS).
pick() {
  awk -v A="$1" 'BEGIN { n = 0 } $1 > 0 { e[n] = $1; a[n] = $2; n++ } END {
    for (i = 0; i + 1 < n; i++) if (a[i] >= A && a[i + 1] <= A && a[i] > a[i + 1]) {
      t = (a[i] - A) / (a[i] - a[i + 1]); printf "%.5g\n", exp(log(e[i]) + t * (log(e[i + 1]) - log(e[i]))); exit }
    b = 0; for (i = 1; i < n; i++) if ((a[i] - A) ^ 2 < (a[b] - A) ^ 2) b = i; printf "%.5g\n", e[b] }' "$out/sweep.tsv"
}
case " $PARTS " in *" main "*)
  E=${EPS:-$(pick ${TARGET_A:-0.7})}; [ "$E" = 0 ] && E=0.01  # no sweep: a guess
  echo "main: EPS $E (target acceptance ${TARGET_A:-0.7})"
  run main 60 $FIX --dummy-residual-scale 1:$E $W --num-speculative-tokens ${K:-4} --max-tokens ${TOKENS:-128} \
      --batches ${BATCHES:-1,8} --reps ${REPS:-3} --modes ${MODES:-off,adaptive,fixed,off} ||
    run main3 50 $FIX --dummy-residual-scale 1:$E $W --num-speculative-tokens ${K:-4} --max-tokens ${TOKENS:-128} \
      --batches ${BATCHES:-1,8} --reps ${REPS:-3} --modes off,adaptive,fixed;;
esac
case " $PARTS " in *" main2 "*)
  E=${EPS2:-$(pick ${TARGET_A2:-0.5})}; [ "$E" = 0 ] && E=0.03
  echo "main2: EPS $E (target acceptance ${TARGET_A2:-0.5})"
  run main2 50 $FIX --dummy-residual-scale 1:$E $W --num-speculative-tokens ${K:-4} --max-tokens ${TOKENS:-128} \
      --batches 1 --reps ${REPS:-3} --modes off,adaptive,fixed;;
esac
case " $PARTS " in *" eps2 "*)  # more acceptance points at batch 1: EPS:K pairs
  for ek in ${EPS_K:-0.0382:4 0.0045:7}; do
    e=${ek%:*}; k=${ek#*:}
    run eps_$e 30 $FIX --dummy-residual-scale 1:$e $W --num-speculative-tokens $k --max-tokens ${TOKENS:-128} \
        --batches 1 --reps ${REPS:-3} --modes off,adaptive,fixed
  done;;
esac
case " $PARTS " in *" draft64 "*)
  run draft64 35 $FIX --dummy-residual-scale 1:${EPS:-0.023113} $W --num-speculative-tokens 4 --max-tokens 64 \
      --batches 32,64 --reps 3 --modes off,adaptive,fixed;;
esac
case " $PARTS " in *" l8b64 "*)
  run l8b64 60 --model $M --load-format dummy $W --repeat 1 --max-tokens 64 --batches 32,64 --reps 3 \
      --modes off,ngram:adaptive,lookahead:adaptive,off;;
esac
tar cJf /tmp/spec8b-all.tar.xz -C "$out" . && rm -f "$out"/* && mv /tmp/spec8b-all.tar.xz "$out/all.tar.xz"
echo "total $(( $(date +%s) - t0 )) s"
