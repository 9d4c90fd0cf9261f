"""Ad-hoc (issue 17, run once before the int8 layout was chosen): real KV of the default model
(HF forward, no vLLM), 30 blocks from chat/code/doc prompts; lossless ratios with and without
byte shuffle, zstd levels, and int8 key SNR per token+head (the codec then) vs per channel+block.
Run: PYTHONPATH=. python docs/results/codec/kv_scales_adhoc.py"""
import json, time, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from pdd.config import ModelConfig
from pdd.engine.model import prepare_model
from pdd.transfer.codec import CodecId, encode, decode_into, to_float32, _shuffle
import zstandard, lz4.block

torch.set_num_threads(1)
path = prepare_model(ModelConfig())
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
prompts = {
 "chat": tok.apply_chat_template([{"role":"user","content":"I am planning a trip to Japan in spring. Which cities should I visit, what should I eat, and how do I get around cheaply? Please give me a detailed plan for two weeks."}]*6, tokenize=False),
 "code": open("/work/wt17/pdd/transfer/tcp_send.py").read()[:6000],
 "doc": open("/work/wt17/docs/architecture.md").read()[:7000],
}
BS = 128
blocks = []
for name, text in prompts.items():
    ids = tok(text, return_tensors="pt").input_ids[:, : (tok(text, return_tensors="pt").input_ids.shape[1] // BS) * BS]
    with torch.no_grad():
        out = model(ids, use_cache=True)
    pkv = out.past_key_values
    layers = []
    for l in range(len(pkv.layers) if hasattr(pkv, "layers") else len(pkv)):
        k, v = (pkv.layers[l].keys, pkv.layers[l].values) if hasattr(pkv, "layers") else pkv[l]
        layers.append(torch.cat([k[0], v[0]], dim=-1))  # [kv_heads, seq, 2*hd]
    kv = torch.stack(layers)  # [L, H, seq, 2hd]
    n = kv.shape[2] // BS
    for b in range(n):
        blocks.append((name, kv[:, :, b*BS:(b+1)*BS, :].contiguous()))
    print(name, ids.shape[1], "tokens", n, "blocks", file=sys.stderr)
shape = tuple(blocks[0][1].shape)
print("block shape", shape, file=sys.stderr)
res = {"shape": shape, "blocks": len(blocks)}
for dtype in ("bfloat16", "float32"):
    raws = [b.to(torch.bfloat16 if dtype=="bfloat16" else torch.float32).view(-1).view(torch.uint8).numpy().tobytes() if dtype=="bfloat16" else b.float().numpy().tobytes() for _, b in blocks]
    total = sum(len(r) for r in raws)
    r = {}
    def timeit(fn, reps=1):
        t0 = time.thread_time(); out = [fn(x) for x in raws]; return out, time.thread_time() - t0
    # unshuffled lossless for comparison
    for lvl in (1, 3):
        c = zstandard.ZstdCompressor(level=lvl)
        outs, t = timeit(lambda x: c.compress(x))
        r[f"zstd{lvl}_noshuffle"] = {"ratio": sum(map(len, outs))/total, "enc_GBps": total/t/1e9}
        outs, t = timeit(lambda x: c.compress(_shuffle(memoryview(x), 2 if dtype=="bfloat16" else 4)))
        r[f"zstd{lvl}_shuffle"] = {"ratio": sum(map(len, outs))/total, "enc_GBps": total/t/1e9}
    outs, t = timeit(lambda x: lz4.block.compress(x, store_size=False))
    r["lz4_noshuffle"] = {"ratio": sum(map(len, outs))/total, "enc_GBps": total/t/1e9}
    for codec in CodecId:
        outs, te = timeit(lambda x: bytes(memoryview(encode(codec, memoryview(x), dtype, shape)).cast("B")))
        dest = bytearray(len(raws[0]))
        t0 = time.thread_time()
        errs = []
        for o, x in zip(outs, raws):
            decode_into(codec, o, memoryview(dest), dtype, shape)
            if codec in (CodecId.INT8, CodecId.INT8_ZSTD):
                a = to_float32(x, dtype).reshape(shape); d = to_float32(bytes(dest), dtype).reshape(shape)
                hd = shape[-1]//2
                for part, sl in (("k", slice(0, hd)), ("v", slice(hd, None))):
                    err = ((d[..., sl]-a[..., sl])**2).sum(); sig = (a[..., sl]**2).sum()
                    errs.append((part, err, sig))
            else:
                assert bytes(dest) == x
        td = time.thread_time() - t0
        entry = {"ratio": sum(map(len, outs))/total, "enc_GBps": total/te/1e9, "dec_GBps": total/td/1e9}
        if errs:
            for part in "kv":
                e = sum(x[1] for x in errs if x[0]==part); s = sum(x[2] for x in errs if x[0]==part)
                entry[f"{part}_snr_db"] = float(10*np.log10(s/e))
        r[codec.name.lower()] = entry
    # alternative int8 for keys: per channel and block (scale per (layer, head, channel) over 128 tokens)
    kerr = ksig = 0.0; vb = 0
    for x in raws:
        a = to_float32(x, dtype).reshape(shape); hd = shape[-1]//2
        k = a[..., :hd]  # [L,H,T,hd]
        s = np.abs(k).max(axis=2, keepdims=True)/127; s = s.astype(np.float16).astype(np.float32); s[s==0]=1
        q = np.clip(np.rint(k/s), -127, 127)*s
        if dtype == "bfloat16":
            q = to_float32(((q.astype(np.float32).view(np.uint32) + 0x7FFF + ((q.astype(np.float32).view(np.uint32)>>16)&1))>>16).astype(np.uint16).tobytes(), dtype).reshape(k.shape)
        kerr += ((q-k)**2).sum(); ksig += (k**2).sum()
    r["int8_keys_per_channel_block"] = {"k_snr_db": float(10*np.log10(ksig/kerr)), "k_scale_bytes_per_block": 2*shape[0]*shape[1]*(shape[-1]//2), "k_scale_bytes_per_token_head": 2*shape[0]*shape[1]*shape[2]}
    res[dtype] = r
print(json.dumps(res, indent=1))
