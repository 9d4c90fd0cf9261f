#!/bin/bash
# A/B of router.pdd.min_catch_up_rounds on the lab: catch_up p_rld_md cold prompts, switch gap.
# usage: switch_ab.sh OUTDIR "1 0 1 0" WORDS TOKENS REPEATS
set -u
cd /work/main
OUT=$1; ORDER=$2; WORDS=${3:-830}; TOKENS=${4:-64}; REP=${5:-3}
mkdir -p $OUT
i=0
for R in $ORDER; do
  i=$((i+1))
  LOG=$OUT/serve-$i-r$R.log
  .venv/bin/pdd serve --config configs/lab.yaml --set router.pdd.min_catch_up_rounds=$R > $LOG 2>&1 &
  SP=$!
  for t in $(seq 1 300); do grep -q "pdd ready" $LOG && break; sleep 1; done
  grep -q "pdd ready" $LOG || { echo "serve $i not ready"; kill -INT $SP; wait $SP; exit 1; }
  date -u +%T
  .venv/bin/pdd bench handoff-gap --url http://10.77.0.6:8000/v1 --tokens $TOKENS \
    --prompt-words $WORDS --repeats $REP --handoffs catch_up --out $OUT/run$i-r$R 2>&1 | tail -n $REP
  kill -INT $SP; wait $SP
  sleep 3
done
date -u +%T
