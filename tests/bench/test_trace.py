"""Trace replay parsing: good lines become ordered requests, bad lines fail with line numbers."""

from __future__ import annotations

import json

import pytest

from pdd.bench.serve.config import TraceConfig
from pdd.bench.serve.trace import load_trace
from pdd.errors import ConfigError


def _write(tmp_path, lines):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def _msg(text):
    return [{"role": "user", "content": text}]


GOOD = [
    {"timestamp": 102.0, "conversation_id": "a", "messages": _msg("a2"), "max_tokens": 8},
    {"timestamp": 100.0, "conversation_id": "a", "messages": _msg("a1"), "max_tokens": 16},
    "",
    {"timestamp": 101.0, "prompt": "raw text", "max_tokens": 4, "extra_field": 1},
    {"timestamp": 104.0, "conversation_id": "b", "messages": _msg("b1"), "max_tokens": 32},
]


def test_good_trace_replays_in_time_order_with_turns_chained(tmp_path):
    wl = load_trace(_write(tmp_path, GOOD), TraceConfig(speed=2.0))
    reqs = wl.requests
    assert [r.index for r in reqs] == [0, 1, 2, 3]
    assert [r.messages[0][1] if r.messages else r.prompt for r in reqs] == [
        "a1",
        "raw text",
        "a2",
        "b1",
    ]
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 1.0, 2.0]
    assert [r.max_tokens for r in reqs] == [16, 4, 8, 32]
    assert [r.conversation for r in reqs] == ["a", "line4", "a", "b"]
    assert [r.after for r in reqs] == [None, None, 0, None]
    assert [r.endpoint() for r in reqs] == [
        "/chat/completions",
        "/completions",
        "/chat/completions",
        "/chat/completions",
    ]
    assert reqs[1].payload() == {"prompt": "raw text", "max_tokens": 4}
    assert all(r.target_hit is None and not r.warmup for r in reqs)


def test_trace_warmup_and_limit(tmp_path):
    cfg = TraceConfig(warmup_requests=1, max_requests=3, wait_for_previous_turn=False)
    reqs = load_trace(_write(tmp_path, GOOD), cfg).requests
    assert [(r.warmup, r.arrival_s, r.after) for r in reqs] == [
        (True, None, None),
        (False, 0.0, None),
        (False, 1.0, None),
    ]


def test_bad_lines_are_all_reported_with_line_numbers(tmp_path):
    path = _write(
        tmp_path,
        [
            GOOD[0],
            "{not json",
            "[1, 2]",
            {"timestamp": 1, "max_tokens": 4},
            {"timestamp": 1, "prompt": "x", "messages": _msg("y"), "max_tokens": 4},
            {"timestamp": 1, "prompt": "x", "max_tokens": -1},
            {"timestamp": "soon", "prompt": "x", "max_tokens": 4},
            {"timestamp": 1, "messages": [{"role": "user"}], "max_tokens": 4},
        ],
    )
    with pytest.raises(ConfigError) as info:
        load_trace(path, TraceConfig())
    lines = info.value.message.splitlines()
    assert lines[0] == f"7 bad line(s) in trace {path}:"
    assert lines[1:] == [
        f"  {path}:2: not valid JSON (Expecting property name enclosed in double quotes)",
        f"  {path}:3: expected a JSON object, got list",
        f"  {path}:4: give exactly one of messages and prompt",
        f"  {path}:5: give exactly one of messages and prompt",
        f"  {path}:6: max_tokens: Input should be greater than 0",
        f"  {path}:7: timestamp: Input should be a valid number, unable to parse string as a "
        "number",
        f"  {path}:8: messages.0.content: Field required",
    ]


def test_missing_and_empty_traces(tmp_path):
    with pytest.raises(ConfigError, match="trace file not found"):
        load_trace(tmp_path / "nope.jsonl", TraceConfig())
    with pytest.raises(ConfigError, match="holds no requests"):
        load_trace(_write(tmp_path, ["", "  "]), TraceConfig())
