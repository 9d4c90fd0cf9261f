"""Structured outputs that resume across tiers: a vLLM v1 logits processor over xgrammar.

Why not vLLM's own structured outputs: vLLM advances its grammar matcher only on the tokens
its engine sampled (``StructuredOutputManager`` from the request's first *output* token). A
pdd tier that continues a request (RLD after P, MD after a handoff, a takeover) gets the tokens
already emitted as *prompt* tokens, so vLLM's matcher would start at the grammar's start state
while the text is already inside the JSON. This processor is given that state instead:
``SamplingParams.extra_args["pdd_constraint"] = {"kind", "spec", "resume"}``, where ``resume``
is every token the client has seen since the constraint began (the router's emitted list).

Why resuming is exact: an xgrammar matcher's state is a pure function of the token sequence it
has accepted, so a matcher built here and fed ``resume`` is in the state the previous tier's
matcher was in after emitting those tokens; the allowed next tokens, and therefore greedy
output, are those of one engine decoding the whole answer under the same constraint.

Lifecycle (engine-core process): vLLM builds one ``ConstraintLogitsProcessor`` per engine
(``logits_processors`` engine arg, ``Engine._engine_args``). ``update_state`` sees requests
join (a matcher is built and ``resume`` replayed), leave (dropped) and move between batch
rows. ``apply`` runs before each sampling step: it feeds each matcher the request's newly
sampled tokens (``output_tok_ids`` is vLLM's live list) and masks the row's logits. The
tokenizer and the grammar compiler are built on the first constrained request only.
``check_spec`` (pure, no tokenizer) is the 400 path: the worker calls it before vLLM does.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.structured_output.backend_xgrammar import has_xgrammar_unsupported_json_features
from vllm.v1.structured_output.utils import grammar_is_likely_lark

from pdd.engine.batch_rows import update_rows
from pdd.engine.types import CONSTRAINT_KINDS, ConstraintSpec
from pdd.errors import InvalidRequestError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)

EXTRA_KEY = "pdd_constraint"  # SamplingParams.extra_args key the router's constraint rides in
FQCN = "pdd.engine.constraint:ConstraintLogitsProcessor"  # the engine arg that registers it
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (vLLM's ``choice_as_grammar``)."""
    esc = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def lit(s: str) -> str:
        return "".join(
            esc.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c) for c in s
        )

    return "root ::= " + " | ".join(f'"{lit(c)}"' for c in choices)


def _literal(text: str) -> xgr.Grammar:
    return xgr.Grammar.from_ebnf(choice_grammar([text]))


def tool_call_grammar(alternatives: list[dict[str, Any]]) -> xgr.Grammar:
    """One of the alternatives: ``prefix`` (literal), arguments per ``schema``, ``suffix``."""
    options = []
    for alt in alternatives:
        parts = [_literal(alt["prefix"])] if alt.get("prefix") else []
        parts.append(xgr.Grammar.from_json_schema(json.dumps(alt["schema"])))
        parts += [_literal(alt["suffix"])] if alt.get("suffix") else []
        options.append(parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts))
    if not options:
        raise ValueError("no tool to call")
    return options[0] if len(options) == 1 else xgr.Grammar.union(*options)


def grammar_of(spec: ConstraintSpec) -> xgr.Grammar:
    """The xgrammar grammar of ``spec`` (no tokenizer needed). Raises InvalidRequestError
    naming ``spec.param`` for a schema, regex, choice list or grammar xgrammar refuses."""
    try:
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}')
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.spec)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_grammar(json.loads(spec.spec)))
        if spec.kind == "tool_call":
            return tool_call_grammar(json.loads(spec.spec))
        if grammar_is_likely_lark(spec.spec):  # "grammar": Lark or EBNF, as vLLM tells them
            return xgr.Grammar.from_lark(spec.spec)
        return xgr.Grammar.from_ebnf(spec.spec)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:  # xgrammar: RuntimeError
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        first = _XGR_PREFIX.sub("", lines[0])  # "[hh:mm:ss] /project/cpp/x.cc:83: ..."
        raise InvalidRequestError(
            f"{spec.param}: invalid {spec.kind.replace('_', ' ')}: {first}", param=spec.param
        ) from exc


def check_spec(spec: ConstraintSpec, vocab_size: int) -> None:
    """400 (InvalidRequestError naming the parameter) unless ``spec`` can be served."""
    if spec.kind not in CONSTRAINT_KINDS:
        raise InvalidRequestError(f"unknown constraint kind {spec.kind!r}", param=spec.param)
    if vocab_size and not all(0 <= t < vocab_size for t in spec.resume):
        raise InvalidRequestError(
            f"constraint resume token ids must be in [0, {vocab_size})", param=spec.param
        )
    grammar_of(spec)
    schemas = []
    if spec.kind == "json_schema":
        schemas = [json.loads(spec.spec)]
    elif spec.kind == "tool_call":
        schemas = [alt["schema"] for alt in json.loads(spec.spec)]
    for schema in schemas:
        if isinstance(schema, dict) and has_xgrammar_unsupported_json_features(schema):
            raise InvalidRequestError(
                f"{spec.param}: the schema uses a JSON Schema feature the grammar backend "
                "(xgrammar) does not enforce (multipleOf, uniqueItems, contains, multi-branch "
                "allOf, an unknown string format, ...)",
                param=spec.param,
            )


def spec_from_extra(params: SamplingParams) -> ConstraintSpec | None:
    raw = (params.extra_args or {}).get(EXTRA_KEY)
    if raw is None:
        return None
    return ConstraintSpec(
        kind=raw["kind"], spec=raw["spec"], resume=tuple(raw.get("resume", ())),
        param=raw.get("param", "response_format"),
    )  # fmt: skip


def to_extra(spec: ConstraintSpec) -> dict[str, Any]:
    return {"kind": spec.kind, "spec": spec.spec, "resume": list(spec.resume), "param": spec.param}


@dataclass
class _Row:
    """One constrained request in a batch row: its matcher and how far it has read."""

    matcher: xgr.GrammarMatcher | None  # None: it could not be built (the row is broken)
    output: list[int]  # vLLM's live output list of the request
    seen: int = 0  # output tokens already fed to the matcher
    broken: bool = False  # a token the grammar refused: only stop tokens are allowed now
    stop_ids: list[int] = field(default_factory=list)


class _Compiler:
    """The tokenizer's xgrammar compiler, built once per engine on first use (~1-2 s)."""

    def __init__(self, vllm_config: VllmConfig) -> None:
        from transformers import AutoTokenizer

        mc = vllm_config.model_config
        tok = AutoTokenizer.from_pretrained(mc.tokenizer, trust_remote_code=mc.trust_remote_code)
        self.vocab_size = mc.get_vocab_size()
        gen = mc.try_get_generation_config() or {}
        eos = gen.get("eos_token_id", tok.eos_token_id)
        self.eos = [eos] if isinstance(eos, int) else list(eos or [])
        info = xgr.TokenizerInfo.from_huggingface(
            tok, vocab_size=self.vocab_size, stop_token_ids=self.eos or None
        )
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)

    def compile(self, spec: ConstraintSpec) -> xgr.CompiledGrammar:
        if spec.kind == "json_schema":  # the compiler caches a schema string's result
            return self.compiler.compile_json_schema(spec.spec)
        if spec.kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}')
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.spec)
        if spec.kind == "grammar" and grammar_is_likely_lark(spec.spec):
            return self.compiler.compile_lark(spec.spec)
        return self.compiler.compile_grammar(grammar_of(spec))


class ConstraintLogitsProcessor(LogitsProcessor):
    """Masks each constrained row to the tokens its grammar allows next (see module doc)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        self._config = vllm_config
        self._compiler: _Compiler | None = None
        self._rows: dict[int, _Row] = {}
        self._bitmask: torch.Tensor | None = None

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """vLLM's admission hook (frontend, inside ``AsyncLLM.generate``): the shape only.
        The grammar itself was checked by ``Engine.validate`` (``check_spec``) before; not
        building it twice keeps the time before the request reaches the engine core short."""
        raw = (sampling_params.extra_args or {}).get(EXTRA_KEY)
        if raw is None:
            return
        if not isinstance(raw, dict) or raw.get("kind") not in CONSTRAINT_KINDS:
            raise ValueError(f"{EXTRA_KEY} must be a constraint of kind {CONSTRAINT_KINDS}")
        if not isinstance(raw.get("spec"), str) or not all(
            isinstance(t, int) and t >= 0 for t in raw.get("resume", ())
        ):
            raise ValueError(f"{EXTRA_KEY} needs a text spec and non-negative resume ids")

    def is_argmax_invariant(self) -> bool:
        return False  # a mask changes the argmax

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        update_rows(self._rows, batch_update, self._row_for)

    def _row_for(
        self, params: SamplingParams, _prompt: list[int] | None, output: list[int]
    ) -> _Row | None:
        spec = spec_from_extra(params)
        return None if spec is None else self._new_row(spec, params, output)

    def _new_row(self, spec: ConstraintSpec, params: SamplingParams, output: list[int]) -> _Row:
        """A matcher in the state after ``spec.resume``. Never raises: this runs inside the
        engine core's step, where an exception kills the engine for every request; a spec
        that cannot be built (validated before, so not expected) gives a broken row."""
        stop_ids = list(params.stop_token_ids or ())
        try:
            if self._compiler is None:
                self._compiler = _Compiler(self._config)
            c = self._compiler
            stop_ids = stop_ids or c.eos
            matcher = xgr.GrammarMatcher(c.compile(spec), override_stop_tokens=stop_ids or None)
        except Exception:  # see above: logged, and the request ends
            log.exception("constraint %s could not be built: the request ends", spec.kind)
            return _Row(None, output, broken=True, stop_ids=stop_ids)
        row = _Row(matcher, output, stop_ids=stop_ids)
        if replay(row, spec.resume) != len(spec.resume):
            row.broken = True  # a resume id is never a placeholder
        return row

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Advance each matcher over the request's new tokens, then mask its row.
        ``logits``: [batch rows, vocab (padded)]; masked in place."""
        if not self._rows:
            return logits
        rows = sorted(i for i in self._rows if i < logits.shape[0])
        vocab = self._config.model_config.get_vocab_size()
        if self._bitmask is None or self._bitmask.shape[0] < logits.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(max(logits.shape[0], 8), vocab)
        broken = []
        for i in rows:
            row = self._rows[i]
            row.seen += replay(row, row.output[row.seen :])
            if row.broken:
                broken.append(i)
            else:
                assert row.matcher is not None  # only a broken row has none
                row.matcher.fill_next_token_bitmask(self._bitmask, i)
        live = [i for i in rows if i not in broken]
        if live:
            mask = self._bitmask.to(logits.device, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=vocab, indices=live)
        for i in broken:  # only the request's stop tokens: it ends now
            if not self._rows[i].stop_ids:
                continue
            keep = logits[i, self._rows[i].stop_ids].clone()
            logits[i] = float("-inf")
            logits[i, self._rows[i].stop_ids] = keep
        return logits


def replay(row: _Row, tokens: list[int] | tuple[int, ...]) -> int:
    """Feed ``tokens`` to the row's matcher; returns how many were consumed (all but an
    async-scheduling placeholder (-1) and what follows it, read again next step). A refused
    token (never expected: every token was sampled under the same grammar) breaks the row:
    from then on only its stop tokens pass, so the request ends instead of leaving the grammar."""
    for n, t in enumerate(tokens):
        if t < 0:
            return n
        if row.broken or row.matcher is None or row.matcher.is_terminated():
            continue
        if not row.matcher.accept_token(t):
            log.error("constraint refused token %d: the request ends on a stop token", t)
            row.broken = True
    return len(tokens)
