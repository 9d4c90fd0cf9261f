"""``pdd profile``: time one worker kind's real engine and write its chip profile.

    pdd profile --config configs/local.yaml --worker md --name cpu --price 0.05 \\
                --out cpu.yaml [--lengths 128,512,1024] [--batches 1,2,4,8] [--set k=v ...]

Starts the worker's engine (its config's model and ``engine_for(worker)`` section) in this
process, without its gRPC service or KV plane, and times, with token-ID prompts of random
tokens (a fresh vLLM cache salt per cold prompt, so nothing hits by accident):

    prefill   TTFT of a cold prompt of each ``--lengths`` (max_tokens 1), and of the same
              prompt again plus one block (its cached prefix: ``new = block``)
    extend    a cached prefix (the longest length) plus k new tokens, each ``--extend-tokens``:
              MainDecode's extend-decode is that one multi-token forward
    decode    ``--batches`` requests at once at two prompt lengths; the step is the median gap
              between tokens while every one of them decodes
    read      KV bytes per token (the engine's geometry), device KV capacity (vLLM's blocks),
              max_num_seqs, the host tier (``cache.host_capacity_gib``, main_decode only)
    served    first, before the engine starts here: ``--served`` pairs of requests through a
              one-worker pdd of the same engine (``pdd serve``: router + colocated worker, on
              the worker's cores), after one untimed request: a cold text prompt of
              ``--served-tokens`` words and it again plus two blocks; each one's TTFT from
              the client, its shape from the usage the server reports. The engine then times
              a prompt of each shape: the differences fit the profile's ``serving`` (per
              request, per new token: router, gRPC, streaming)

then fits the planner's closed forms (``pdd.plan.fit``) and writes the profile in the schema of
``configs/profiles/*.yaml`` (YAML; JSON when ``--out`` ends in .json). Each run's median of
``--repeats`` is one sample. Exit codes: 0 written, 1 the engine failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdd.bench.serve.client import stream_request
from pdd.bench.serve.config import ModeConfig
from pdd.bench.serve.systems import ServedTopology
from pdd.bench.serve.workload import BenchRequest
from pdd.config import PddConfig, WorkerConfig, load_config
from pdd.engine.env import configure_process_env
from pdd.errors import ConfigError, PddError
from pdd.plan.fit import (
    DecodeSample,
    ExtendSample,
    Measured,
    OverheadSample,
    PrefillSample,
    fit_profile,
)
from pdd.protocol import Role

GIB = 1 << 30
READY_TIMEOUT_S = 600.0  # the served pdd's start (its engine loads the model)
SERVED_TIMEOUT_S = 120.0  # one served request


@dataclass(frozen=True)
class Plan:
    """What to time (validated against the engine's limits by ``check``)."""

    lengths: tuple[int, ...]
    batches: tuple[int, ...]
    extend_tokens: tuple[int, ...]
    decode_tokens: int = 32
    repeats: int = 3
    seed: int = 0
    served: int = 0  # pairs of requests through a one-worker pdd (0: overhead not measured)
    served_tokens: int = 1024  # the cold prompt's length, in words (about a token each)

    def check(self, max_model_len: int, block: int, max_seqs: int) -> None:
        if len(set(self.lengths)) < 2 or min(self.lengths) < block:
            raise ConfigError(f"--lengths: give at least two lengths of at least one block "
                              f"({block} tokens)")  # fmt: skip
        longest = max(self.lengths) // block * block + block + max(self.extend_tokens)
        if longest >= max_model_len:
            raise ConfigError(f"--lengths/--extend-tokens: {longest} tokens do not fit "
                              f"max_model_len {max_model_len}")  # fmt: skip
        if len(set(self.batches)) < 2 or max(self.batches) > max_seqs or min(self.batches) < 1:
            raise ConfigError(f"--batches: give at least two batch sizes in [1, {max_seqs}] "
                              f"(max_num_seqs)")  # fmt: skip
        if len(set(self.extend_tokens)) < 2 or min(self.extend_tokens) < 1:
            raise ConfigError("--extend-tokens: give at least two counts >= 1")
        if self.decode_tokens < 4 or self.decode_tokens + min(self.lengths) >= max_model_len:
            raise ConfigError("--decode-tokens: at least 4, and prompt + tokens within "
                              "max_model_len")  # fmt: skip
        if self.repeats < 1:
            raise ConfigError("--repeats: at least 1")
        if self.served < 0:
            raise ConfigError("--served: 0 or more")
        if self.served and not block <= self.served_tokens < max_model_len - 3 * block - 1:
            raise ConfigError(f"--served-tokens: between one block ({block}) and "
                              f"max_model_len - 3 blocks ({max_model_len - 3 * block - 1})")  # fmt: skip

    @property
    def steps(self) -> int:
        return (2 * len(self.lengths) + len(self.extend_tokens) + 2 * len(self.batches)
                + 4 * self.served)  # served requests, then the engine at their shapes  # fmt: skip


class Progress:
    """tqdm on a terminal, else one line per step (readable in logs)."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.stream, self.total, self.done, self._bar = stream, total, 0, None
        if stream.isatty():
            with contextlib.suppress(ImportError):
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc="pdd profile", file=stream, leave=False)

    def step(self, what: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(what)
            self._bar.update(1)
        else:
            print(f"[profile {self.done}/{self.total}] {what}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Timer:
    """Times requests on one started ``pdd.engine.engine.Engine``."""

    def __init__(self, engine: Any, plan: Plan) -> None:
        from pdd.engine.types import SamplingSpec

        self.engine, self.plan, self._n = engine, plan, 0
        self.rng = random.Random(plan.seed)
        self.spec = SamplingSpec
        self.block = engine.engine_config.block_size

    def tokens(self, n: int) -> list[int]:
        top = max(self.engine.vocab_size - 100, 200)
        return [self.rng.randrange(100, top) for _ in range(n)]

    def _id(self) -> str:
        self._n += 1
        return f"profile-{self._n}"

    async def run(self, prompt: list[int], max_tokens: int, salt: str) -> list[tuple[float, int]]:
        """(seconds since the call, tokens) per delta that carried tokens."""
        spec = self.spec(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0, out = time.perf_counter(), []
        stream = self.engine.generate(self._id(), prompt, spec, cache_salt=salt)
        async with contextlib.aclosing(stream) as deltas:
            async for d in deltas:
                if d.token_ids:
                    out.append((time.perf_counter() - t0, len(d.token_ids)))
        return out

    async def ttft(self, prompt: list[int], salt: str) -> float:
        return (await self.run(prompt, 1, salt))[0][0]

    async def cold(self, n: int) -> float:
        times = [
            await self.ttft(self.tokens(n), f"cold-{self._n}") for _ in range(self.plan.repeats)
        ]
        return statistics.median(times)

    async def cached(self, base: list[int], salt: str, extra: int) -> float:
        """TTFT of ``base`` (already prefilled under ``salt``) plus ``extra`` new tokens."""
        times = [await self.ttft(base + self.tokens(extra), salt) for _ in range(self.plan.repeats)]
        return statistics.median(times)

    async def decode_step(self, batch: int, length: int) -> float:
        """Median gap per token while all ``batch`` requests decode together."""
        runs = await asyncio.gather(*(
            self.run(self.tokens(length), self.plan.decode_tokens, f"dec-{self._n}-{i}")
            for i in range(batch)))  # fmt: skip
        start = max(r[0][0] for r in runs)  # every request has its first token
        end = min(r[-1][0] for r in runs)  # none has finished
        gaps = [(t - prev) / n for r in runs for (prev, _), (t, n) in zip(r, r[1:], strict=False)
                if prev >= start and t <= end]  # fmt: skip
        if not gaps:
            raise PddError(f"batch {batch}: no step where all {batch} requests decoded; "
                           f"raise --decode-tokens")  # fmt: skip
        return statistics.median(gaps)


async def measure(engine: Any, plan: Plan, name: str, host_cache_tokens: int,
                  progress: Progress, served: tuple[Served, ...] = ()) -> Measured:  # fmt: skip
    """Every sample of ``plan`` on a started engine (see the module docstring); ``served``:
    the TTFTs a one-worker pdd gave, each matched here by the engine's own at its shape."""
    cfg = engine.engine_config
    block = cfg.block_size
    plan.check(cfg.max_model_len, block, cfg.max_num_seqs)
    timer = Timer(engine, plan)
    prefill: list[PrefillSample] = []
    for n in plan.lengths:
        prefill.append(PrefillSample(n, 0, await timer.cold(n)))
        progress.step(f"prefill {n} cold")
        base, salt = timer.tokens(n // block * block), f"warm-{n}"
        await timer.ttft(base, salt)
        prefill.append(PrefillSample(block, len(base), await timer.cached(base, salt, block)))
        progress.step(f"prefill {block} over {len(base)} cached")
    base = timer.tokens(max(plan.lengths) // block * block)
    await timer.ttft(base, "extend")
    extend = []
    for k in plan.extend_tokens:
        seconds = await timer.cached(base, "extend", k)
        extend.append(ExtendSample(k, seconds))
        prefill.append(PrefillSample(k, len(base), seconds))
        progress.step(f"extend {k} over {len(base)}")
    overhead = []
    for x in served:
        if x.cached_tokens:
            base, salt = timer.tokens(x.cached_tokens), f"served-{timer._id()}"
            await timer.ttft(base, salt)
            engine_s = await timer.cached(base, salt, x.new_tokens)
        else:
            engine_s = await timer.cold(x.new_tokens)
        overhead.append(OverheadSample(x.new_tokens, x.cached_tokens, x.seconds, engine_s))
        progress.step(f"engine at served shape {x.new_tokens} over {x.cached_tokens}: "
                      f"{engine_s * 1e3:.0f} ms (served {x.seconds * 1e3:.0f} ms)")  # fmt: skip
    decode = []
    short, long_ = min(plan.lengths), max(plan.lengths)
    for b in plan.batches:
        for n in (short, long_):
            step = await timer.decode_step(b, n)
            decode.append(DecodeSample(b, b * (n + plan.decode_tokens / 2), step))
            progress.step(f"decode batch {b} at {n} tokens: {step * 1e3:.1f} ms/step")
    per_token = engine.kv_block_bytes // block
    capacity = engine.kv_capacity_tokens or int(cfg.kv_cache_space_gib * GIB) // per_token
    return Measured(
        name=name, model=engine.model_config.name,
        kv_bytes_per_token=per_token, block_size=block,
        chunk_tokens=engine.step_tokens() or max(cfg.max_model_len, 2048),
        kv_capacity_tokens=capacity, max_batch=cfg.max_num_seqs,
        host_cache_tokens=host_cache_tokens,
        prefill=tuple(prefill), decode=tuple(decode), extend=tuple(extend),
        notes=_notes(engine, plan), overhead=tuple(overhead),
    )  # fmt: skip


# --- served: the same engine behind pdd's router, timed from a client --------------------------


@dataclass(frozen=True)
class Served:
    """One request through a running pdd: its shape as the server counted it, its TTFT."""

    new_tokens: int
    cached_tokens: int
    seconds: float


WORDS = ("river stone cloud market engine garden silver window planet forest music letter "
         "bridge candle orange winter harbor pencil mirror valley").split()  # fmt: skip


async def _ttft(http: httpx.AsyncClient, model: str, prompt: str) -> Served:
    """One streamed completion (one token, never EOS) timed by the benchmark's client; its
    TTFT and its shape as the server's usage counts it."""
    req = BenchRequest(index=0, group="served", warmup=False, conversation="served",
                       max_tokens=1, prompt=prompt)  # fmt: skip
    body = dict(req.payload(), model=model, temperature=0, ignore_eos=True)
    rec = await stream_request(http, req, body, SERVED_TIMEOUT_S, time.perf_counter())
    if rec.error is not None or rec.ttft_s is None:
        raise PddError(f"served request to {http.base_url}: {rec.error}")
    return Served(rec.prompt_tokens - rec.cached_tokens, rec.cached_tokens, rec.ttft_s)


async def served_ttfts(url: str, model: str, plan: Plan, block: int,
                       progress: Progress | None = None) -> tuple[Served, ...]:  # fmt: skip
    """``plan.served`` pairs against the pdd at ``url``: a cold prompt of random words (its
    head differs, so nothing hits), then the same plus two blocks' worth of words. One short
    request first, untimed: a fresh server's first request pays its lazy set-up."""
    rng, out = random.Random(plan.seed), []
    async with httpx.AsyncClient(base_url=url) as http:
        with contextlib.suppress(PddError):  # a real failure fails below
            await _ttft(http, model, " ".join(WORDS))
        for _ in range(plan.served):
            base = " ".join(rng.choice(WORDS) for _ in range(plan.served_tokens))
            more = " ".join(rng.choice(WORDS) for _ in range(2 * block))
            for prompt in (base, f"{base} {more}"):
                out.append(await _ttft(http, model, prompt))
                if progress is not None:
                    x = out[-1]
                    progress.step(f"served {x.new_tokens} over {x.cached_tokens}: "
                                  f"{x.seconds * 1e3:.0f} ms")  # fmt: skip
    return tuple(out)


def served_config(cfg: PddConfig, worker: WorkerConfig) -> dict:
    """A one-worker colocated topology of ``worker``'s model and engine (its cores too), on
    ports picked at start, for ``pdd serve``."""
    return {
        "model": cfg.model.model_dump(mode="json"),
        "engine": cfg.engine_for(worker.id).model_dump(mode="json"),
        "router": {"host": "127.0.0.1", "port": 0, "mode": "colocated"},
        "workers": [{"id": "profiled", "role": "colocated", "host": "127.0.0.1"}],
    }  # fmt: skip


def _served(cfg: PddConfig, worker: WorkerConfig, plan: Plan, progress: Progress,
            folder: Path) -> tuple[Served, ...]:  # fmt: skip
    topo_file = folder / "served.yaml"
    topo_file.write_text(yaml.safe_dump(served_config(cfg, worker), sort_keys=False))
    served = ServedTopology(ModeConfig(name="profiled", config=topo_file), READY_TIMEOUT_S,
                            folder / "served.log")  # fmt: skip
    url = served.start()
    try:
        block = cfg.engine_for(worker.id).block_size
        return asyncio.run(served_ttfts(url, cfg.model.name, plan, block, progress))
    finally:
        served.stop()


def _notes(engine: Any, plan: Plan) -> tuple[str, ...]:
    cfg = engine.engine_config
    return (
        f"Measured by pdd profile on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
        f"vLLM engine, dtype {cfg.dtype or engine.model_config.dtype}, block {cfg.block_size}, "
        f"max_num_batched_tokens {engine.step_tokens()}, no KV connector (the "
        f"connector's copies are not in these times; the router's and gRPC's are in "
        f"`serving` when --served measured them).",
        f"Samples: prompt lengths {list(plan.lengths)} cold and cached, extend "
        f"{list(plan.extend_tokens)} tokens, decode batches {list(plan.batches)} x "
        f"{plan.decode_tokens} tokens at two prompt lengths; median of {plan.repeats} per "
        f"prefill sample. Times include vLLM's scheduling and streaming overhead.",
        "max_batch is the engine's max_num_seqs; kv_capacity_tokens vLLM's KV blocks x block.",
    )


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a list of integers") from None
    if not values:
        raise ConfigError(f"{flag}: empty")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdd profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="YAML topology config")
    ap.add_argument("--worker", required=True, help="the worker whose engine to time")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--out", type=Path, required=True, help="profile to write (.yaml or .json)")
    ap.add_argument("--name", default=None, help="chip kind name (default: the worker id)")
    ap.add_argument("--price", type=float, required=True, help="cost of one instance per hour")
    ap.add_argument("--description", default="", help="what this chip is")
    ap.add_argument("--lengths", default=None, help="prompt lengths (default: up to max_model_len)")
    ap.add_argument("--batches", default=None, help="decode batch sizes (default 1,2,4,8)")
    ap.add_argument("--extend-tokens", default="1,16,64", help="handed-off token counts")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens per decode request")
    ap.add_argument("--repeats", type=int, default=3, help="runs per prefill sample")
    ap.add_argument("--served", type=int, default=4,
                    help="pairs of requests through a one-worker pdd, for the profile's serving "
                         "(0: not measured)")  # fmt: skip
    ap.add_argument("--served-tokens", type=int, default=None,
                    help="words in each served cold prompt, about a token each (default: "
                         "1024, at most half of max_model_len)")  # fmt: skip
    return ap


def _plan(args: argparse.Namespace, cfg: PddConfig, worker: WorkerConfig) -> Plan:
    e = cfg.engine_for(worker.id)
    room = e.max_model_len - e.block_size - 64 - 1
    lengths = (_ints(args.lengths, "--lengths") if args.lengths
               else tuple(n for n in (128, 512, 1024, 2048, 4096) if n <= room) or (e.block_size,))  # fmt: skip
    batches = (_ints(args.batches, "--batches") if args.batches
               else tuple(b for b in (1, 2, 4, 8) if b <= e.max_num_seqs))  # fmt: skip
    return Plan(lengths, batches, _ints(args.extend_tokens, "--extend-tokens"),
                args.decode_tokens, args.repeats, served=args.served,
                served_tokens=args.served_tokens or min(1024, e.max_model_len // 2))  # fmt: skip


async def _profile(cfg: PddConfig, worker: WorkerConfig, plan: Plan, name: str,
                   progress: Progress, served: tuple[Served, ...]) -> Measured:  # fmt: skip
    from pdd.engine.engine import Engine  # imports vLLM: after the environment is set

    engine = Engine(cfg.model, cfg.engine_for(worker.id), streams_kv=cfg.streams_kv(worker.id))
    await engine.start()
    try:
        host = 0
        if worker.role is Role.MAIN_DECODE:
            host = cfg.cache.host_slots(engine.kv_block_bytes) * engine.engine_config.block_size
        return await measure(engine, plan, name, host, progress, served)
    finally:
        await engine.stop()


def write_profile(path: Path, data: dict) -> None:
    text = json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(
        data, sort_keys=False, width=100)  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    configure_process_env()
    try:
        cfg = load_config(args.config, args.overrides)
        worker = cfg.worker(args.worker)
        plan = _plan(args, cfg, worker)
        e = cfg.engine_for(worker.id)
        plan.check(e.max_model_len, e.block_size, e.max_num_seqs)
        progress = Progress(plan.steps)
        try:
            with tempfile.TemporaryDirectory(prefix="pdd-profile-") as folder:
                served = _served(cfg, worker, plan, progress, Path(folder)) if plan.served else ()
            measured = asyncio.run(_profile(cfg, worker, plan, args.name or worker.id, progress,
                                            served))  # fmt: skip
        finally:
            progress.close()
        profile = fit_profile(measured, args.price, args.description)
    except ConfigError as exc:
        print(f"pdd profile: {exc.message}", file=sys.stderr)
        return 2
    except PddError as exc:
        print(f"pdd profile: {exc.message}", file=sys.stderr)
        return 1
    write_profile(args.out, profile.model_dump(mode="json"))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0
