"""One cold streamed request on the lab: the bytes dc-b's WAN interface received over time
(when MD's KV crossed), and the CPU seconds of each process in P's prefill phase (send ->
first token) and the decode phase (first token -> end).

usage (root): pdd serve --config configs/lab.yaml [--set workers.0.engine.max_num_batched_tokens=512] &
              python sample.py WORDS SEED     (a random WORDS-word prompt, 64 tokens streamed)
"""
import json, os, random, sys, threading, time, urllib.request

ROLES = {}
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    try:
        args = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        comm = open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        continue
    if "pdd.lab.relay" in args: ROLES[int(pid)] = "relay"
    elif "pdd.router.main" in args: ROLES[int(pid)] = "router"
    elif "pdd.launch.worker" in args: ROLES[int(pid)] = args.split("--worker ")[1].split()[0] + "-main"
for pid in list(os.listdir("/proc")):
    if not pid.isdigit(): continue
    try:
        comm = open(f"/proc/{pid}/comm").read().strip()
        ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    except OSError: continue
    if comm.startswith("VLLM::EngineCor") and ppid in ROLES:
        ROLES[int(pid)] = ROLES[ppid].replace("-main", "-engine")

def cpu():
    out = {}
    for pid, role in ROLES.items():
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        out[role] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return out

words = "the of and to in is you that it he was for on are as with his they at be this have from or one had by word but not what all were we when your can said there use an each which she do how their if will up other about out many then them these so some her would make like him into time has look two more write go see number no way could people my than first water been call who oil its now find long down day did get come made may part".split()
rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 2400
prompt = " ".join(rng.choice(words) for _ in range(n))
body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 64,
                   "temperature": 0, "ignore_eos": True, "stream": True}).encode()
req = urllib.request.Request("http://10.77.0.6:8000/v1/completions", body,
                             {"Content-Type": "application/json"})
def rx():
    out = os.popen("ip netns exec pdd-dc-b cat /proc/net/dev").read()
    return int([l for l in out.splitlines() if "wan0" in l][0].split(":")[1].split()[0])
series = []; stop = False
def sampler():
    while not stop:
        series.append((time.monotonic(), rx())); time.sleep(0.2)
threading.Thread(target=sampler, daemon=True).start(); time.sleep(0.3)
c0 = cpu(); t0 = time.monotonic(); first = None; last = None; pdd = None
with urllib.request.urlopen(req, timeout=300) as r:
    for line in r:
        line = line.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]": continue
        d = json.loads(line[5:])
        if first is None and d.get("choices") and d["choices"][0].get("text"):
            first = time.monotonic(); c1 = cpu()
        if d.get("pdd"): pdd = d["pdd"]
        last = time.monotonic()
c2 = cpu()
time.sleep(6); stop = True
base = [b for t, b in series if t <= t0][-1]
for t, b in series:
    if t >= t0 and int((t - t0) * 5) % 5 == 0:
        print(f"  t={t - t0:5.1f}s wan rx {(b - base) / 1e6:7.1f} MB")
print(f"  P token at {first - t0:.1f}s, end at {last - t0:.1f}s")
print(f"prompt words {n}; first token {first - t0:.2f} s; decode {last - first:.2f} s; pdd {json.dumps(pdd)[:300]}")
print(f"{'process':12} {'prefill s':>9} {'decode s':>9}")
for role in sorted(c0):
    print(f"{role:12} {c1[role]-c0[role]:9.2f} {c2[role]-c1[role]:9.2f}")
