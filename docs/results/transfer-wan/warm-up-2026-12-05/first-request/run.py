"""First p_md request after a lab fleet starts, warm-up on vs off: times to P's token (TTFT),
MD's first token (the 2nd), and the request's WAN bytes. One fleet start per row."""
import json, sys, time
import httpx
sys.path.insert(0, "/work/main")
from tests.helpers import serve, stop
from pdd.config import load_config

PROMPT = " ".join(f"w{i}" for i in range(420))  # ~1,500 tokens
rows = []
for rnd in range(int(sys.argv[1])):
    for warm in ("on", "off"):
        sets = ["lab.prefix=pdtfirst", "lab.subnet=10.77.9.0/28", "lab.rate_mbit=1000",
                "router.pdd.wan_bandwidth_bps=1e9"]
        if warm == "off":
            sets.append("transfer.warmup_bytes=0")
        s = serve("configs/lab.yaml", [], sets, timeout_s=900)
        try:
            time.sleep(10)  # the router's polls, WarmKv, the warm-up (about a second)
            body = {"model": load_config("configs/lab.yaml").model.name, "prompt": PROMPT,
                    "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True,
                    "pdd": {"pipeline": "p_md"}}
            t0 = time.perf_counter(); times = []; last = None
            with httpx.stream("POST", s.url + "/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        c = json.loads(line[6:])
                        if c.get("choices") and c["choices"][0].get("text"):
                            times.append(time.perf_counter() - t0)
                        last = c
            rec = last.get("pdd", {})
            row = {"round": rnd + 1, "warm_up": warm, "ttft_s": times[0], "md_first_s": times[1],
                   "total_s": times[-1], "wan_kv_bytes": rec.get("wan_kv_bytes"),
                   "md_computed": rec.get("md_computed"), "pipeline": rec.get("pipeline")}
            print(json.dumps(row), flush=True); rows.append(row)
        finally:
            stop(s)
json.dump(rows, open("/tmp/firstreq/rows.json", "w"), indent=1)
