"""The fewest P meeting the SLA with 1 RLD and 56 MD fixed: a bisection over `pdd plan --fleet`.

usage (from the repository root): python docs/results/plan/tail-chunks-static/host-tier/min_p.py
    PROFILE HIT SEED   -> one JSON line: the profile, hit rate, seed, the fewest P, every try
"""

import json
import subprocess
import sys

profile, hit, seed = sys.argv[1], sys.argv[2], sys.argv[3]
WORKLOAD = (f"agentic:requests=128000,rate=32,context_tokens=65536,output_tokens=1024,jitter=0,"
            f"seed={seed},hit_rate={hit}")


def simulate(p: int) -> dict:
    out = subprocess.run(
        [".venv/bin/pdd", "plan", "--profiles", profile, "configs/profiles/chip-b.yaml",
         "--wan", "100Gbps,40ms,0", "--sla", "ttft=5,tpot=0.05,attainment=0.9",
         "--workload", WORKLOAD, "--fleet", f"pdd:P=A*{p},RLD=A*1,MD=B*56", "--json"],
        capture_output=True, text=True)
    return json.loads(out.stdout)


lo, hi, tries = 26, 40, {}  # 26 P fails and 40 meets the SLA at every point tried
while hi - lo > 1:
    mid = (lo + hi) // 2
    d = simulate(mid)
    tries[mid] = {"attainment": round(d["attainment"], 3),
                  "p_busy": round(d["utilisation"]["prefill"], 3), "meets": d["meets_sla"]}
    lo, hi = (lo, mid) if d["meets_sla"] else (mid, hi)
print(json.dumps({"profile": profile, "hit_rate": float(hit), "seed": int(seed), "min_p": hi,
                  "tries": tries}), flush=True)
