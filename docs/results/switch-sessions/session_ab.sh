#!/bin/bash
# A/B/C on the lab: catch_up p_rld_md cold prompts, the gap at the switch.
#   S: min_catch_up_rounds=1, catch_up_sessions=true   (MD keeps the request open)
#   N: min_catch_up_rounds=1, catch_up_sessions=false  (each warm-up a request of its own)
#   M: min_catch_up_rounds=0, catch_up_sessions=false  (main's rule before: no warm-up under 64)
#   Z: min_catch_up_rounds=0, catch_up_sessions=true
# usage: session_ab.sh OUTDIR "S M N S M N" WORDS TOKENS REPEATS
set -u
cd "$(dirname "$0")/../../.."
OUT=$1; ORDER=$2; WORDS=${3:-250}; TOKENS=${4:-64}; REP=${5:-3}
mkdir -p $OUT
i=0
for A in $ORDER; do
  i=$((i+1))
  case $A in
    S) SET="--set router.pdd.min_catch_up_rounds=1 --set router.pdd.catch_up_sessions=true";;
    N) SET="--set router.pdd.min_catch_up_rounds=1 --set router.pdd.catch_up_sessions=false";;
    M) SET="--set router.pdd.min_catch_up_rounds=0 --set router.pdd.catch_up_sessions=false";;
    Z) SET="--set router.pdd.min_catch_up_rounds=0 --set router.pdd.catch_up_sessions=true";;
  esac
  LOG=$OUT/serve-$i-$A.log
  .venv/bin/pdd serve --config configs/lab.yaml $SET > $LOG 2>&1 &
  SP=$!
  for t in $(seq 1 300); do grep -q "pdd ready" $LOG && break; sleep 1; done
  grep -q "pdd ready" $LOG || { echo "serve $i not ready"; kill -INT $SP; wait $SP; exit 1; }
  echo "$(date -u +%T) run $i arm $A"
  .venv/bin/pdd bench handoff-gap --url http://10.77.0.6:8000/v1 --tokens $TOKENS \
    --prompt-words $WORDS --repeats $REP --handoffs catch_up --out $OUT/run$i-$A 2>&1 | tail -n $REP
  kill -INT $SP; wait $SP
  sleep 3
done
date -u +%T
