#!/bin/bash
set -x
cd /work/main
D=/work/notes/validate-1207
date -u
.venv/bin/pdd profile --config configs/local.yaml --worker md --name cpu --price 2 \
  --lengths 128,512,1024,2048 --batches 1,2,4,8 --extend-tokens 1,16,64 --decode-tokens 24 \
  --repeats 2 --out $D/cpu.yaml > $D/profile-cpu.txt 2>&1
.venv/bin/pdd profile --config configs/colocated.yaml --worker w0 --name cpu2 --price 2 \
  --lengths 128,512,1024,2048 --batches 1,2,4,8 --extend-tokens 1,16,64 --decode-tokens 24 \
  --repeats 2 --out $D/cpu2.yaml > $D/profile-cpu2.txt 2>&1
date -u
.venv/bin/pdd lab up --prefix pddbench --subnet 10.77.5.0/28 --delay-ms 10 --rate-mbit 100
.venv/bin/pdd bench serve --config configs/bench/validate.yaml --out $D/run > $D/bench.log 2>&1
date -u
.venv/bin/pdd lab down --prefix pddbench
.venv/bin/pdd plan-validate --run $D/run --profiles $D/cpu.yaml $D/cpu2.yaml \
  --chips C=cpu2,P=cpu,RLD=cpu,MD=cpu --wan 100Mbps,20ms --out $D > $D/validate.txt 2>&1
date -u
echo done
