"""Every JSON file we are handed (routing traces, a step's trace for the replay, benchmark results
files): whatever is wrong with it (deep nesting, a 5000-digit number, not JSON, not UTF-8, the wrong
shape) is a ValueError that starts with the file's path, never a bare RecursionError or Python's digit
limit; a damaged results file is named, never replaced by the new rows alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lancet_rt.routing.traces import FORMAT, RoutingTrace, parse_routing

ROOT = Path(__file__).parents[2]


def _replay_events(path):
    from lancet_rt.autotune.replay_trace import load_events

    return load_events(path)


def _replay_parse(path):
    from lancet_rt.autotune.replay_trace import parse_trace

    return parse_trace(path)


def _results_log(path):
    from bench.common import RowLog

    RowLog(str(path)).add({"bench": "test"})


READERS = {
    "RoutingTrace.load": RoutingTrace.load,
    "parse_routing": lambda path: parse_routing(f"trace:{path}"),
    "replay load_events": _replay_events,
    "replay parse_trace": _replay_parse,
    "bench RowLog": _results_log,
}
DAMAGED = {  # file content -> what the message says
    "deep": ("[" * 100_000, "nested too deeply"),
    "deep-in-a-field": (
        f'{{"format": "{FORMAT}", "traceEvents": ' + "[" * 5000 + "]" * 5000 + "}",
        "nested too deeply",
    ),
    "long-number": (f'{{"format": "{FORMAT}", "loads": [[[' + "9" * 5000 + "]]]}", "out of range"),
    "truncated": ('[{"a": 1}', "not valid JSON"),
    "latin-1": (b'{"name": "\xe9"}', "not a UTF-8 text file"),
}


@pytest.mark.parametrize("content", list(DAMAGED))
@pytest.mark.parametrize("reader", list(READERS))
def test_a_damaged_json_file_is_a_value_error_naming_it(reader, content, tmp_path):
    path = tmp_path / f"{content}.json"
    data, words = DAMAGED[content]
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    with pytest.raises(ValueError) as info:
        READERS[reader](str(path))
    assert str(info.value).startswith(f"{path}: ") and words in str(info.value), str(info.value)
    assert path.read_bytes() == (data if isinstance(data, bytes) else data.encode())  # left as it was


@pytest.mark.parametrize(
    "content,words",
    [
        ({"traceEvents": [1, 2]}, "not a trace"),
        ({"traceEvents": [{"ph": "X", "tid": "tracing"}]}, "an event lacks a field"),
        ({"traceEvents": [{"ph": "X", "tid": "tracing", "ts": 0, "dur": 1}]}, "no MoE 'route' span"),
        ({"traceEvents": [{"ph": "X", "tid": "tracing", "ts": "0", "dur": 1}]}, "of the wrong type"),
    ],
)
def test_a_step_trace_that_is_not_one_is_named_with_its_file(content, words, tmp_path):
    path = tmp_path / "step.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as info:
        _replay_parse(str(path))
    assert str(info.value).startswith(f"{path}: ") and words in str(info.value), str(info.value)


def test_a_results_file_that_is_not_a_list_is_named_and_kept(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not a results file"):
        _results_log(path)
    assert path.read_text() == '{"rows": []}'
    path.write_text('[{"bench": "old"}]')
    _results_log(path)  # a good file still gains the row
    assert json.loads(path.read_text()) == [{"bench": "old"}, {"bench": "test"}]


def test_the_replay_command_names_a_damaged_trace_in_one_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000)
    out = subprocess.run(
        [sys.executable, "-m", "lancet_rt.autotune.replay", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [f"replay: {path}: " + out.stderr.split(f"{path}: ", 1)[1].strip()]
    assert "nested too deeply" in out.stderr
