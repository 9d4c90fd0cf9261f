# Reproduce: sudo .venv/bin/python docs/results/bench-wan-nixl/cold_breakdown.py (brings up and takes down the lab pddbk).
"""vllm_nixl, one cold prompt at a time, the proxy's two steps timed from here: P's answer, then D's first token."""
import time
from pathlib import Path
import httpx
from pdd.bench.serve.config import ModeConfig
from pdd.bench.serve.nixl import VllmNixl
from pdd.bench.serve.nixl_proxy import prefill_body, decode_body
m = ModeConfig(name="x", config=Path("configs/lab.yaml"), server="vllm_nixl",
               overrides=["lab.prefix=pddbk", "lab.subnet=10.99.9.0/28"])
out = Path("/tmp/nx/break"); out.mkdir(exist_ok=True)
s = VllmNixl(m, 600, out)
s.start()
# P's and D's addresses, as the proxy was told them
p_url = [a for a in s._procs[2][1].args if a.startswith("http://")][0]
d_url = [a for a in s._procs[2][1].args if a.startswith("http://")][1]
print("P", p_url, "D", d_url)
ns = s._sites.lab.enter("dc-a")  # the proxy's seat: P local, D across the WAN
try:
  with ns:
    for i, word in enumerate(["alpha", "bravo", "charlie", "delta"]):
        n = 20 if i == 0 else 130
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"{word} " + "the quick brown fox jumps over the lazy dog " * n,
                "max_tokens": 16, "ignore_eos": True, "stream": True, "temperature": 0}
        t0 = time.perf_counter()
        r = httpx.post(p_url + "/v1/completions", json=prefill_body(body), timeout=300)
        t1 = time.perf_counter()
        params = r.json()["kv_transfer_params"]
        first = None
        with httpx.stream("POST", d_url + "/v1/completions", json=decode_body(body, params), timeout=300) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    first = time.perf_counter(); break
        print(f"req {i}: prompt {r.json()['usage']['prompt_tokens']} tokens: P answered in {(t1-t0)*1000:.0f} ms, D's first token {(first-t1)*1000:.0f} ms later, total {(first-t0)*1000:.0f} ms")
finally:
    s.stop()
