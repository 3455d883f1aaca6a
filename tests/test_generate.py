"""`edgespec generate` and the Python API: streaming, JSON, limits and bad input."""
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import one_error_line, quiet, run_cli

import edgespec
from edgespec.errors import EdgespecError
from edgespec.export.pipeline import export_model

JSON_FIELDS = {"text", "tokens", "n_prompt", "n_generated", "prefill_s", "decode_s",
               "decode_tokens_per_s", "mode", "finish_reason", "stats"}
STATS_FIELDS = {"rounds", "drafted", "accepted", "acceptance", "accepted_per_round",
                "tokens_per_round", "draft_s",
                "verify_s", "head_s", "sampling_s"}


def test_json_output_has_the_documented_fields(tiny_int4):
    result = run_cli("generate", tiny_int4, "-p", "hello world", "--max-new-tokens", "12",
                     "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert JSON_FIELDS <= out.keys() and STATS_FIELDS <= out["stats"].keys()
    assert out["n_generated"] == len(out["tokens"]) <= 12 and out["mode"] == "speculative"


def test_plain_and_speculative_cli_runs_print_the_same_greedy_text(tiny_int4):
    args = ["generate", tiny_int4, "-p", "the lazy dog", "--max-new-tokens", "24", "--json"]
    plain = json.loads(run_cli(*args, "--mode", "plain").stdout)
    spec = json.loads(run_cli(*args, "--draft-k", "3").stdout)
    assert plain["mode"] == "plain" and spec["mode"] == "speculative"
    assert plain["tokens"] == spec["tokens"]


def test_stats_prints_the_acceptance_line(tiny_int4):
    result = run_cli("generate", tiny_int4, "-p", "hello", "--max-new-tokens", "16", "--stats")
    assert result.returncode == 0, result.stderr
    assert re.search(r"accepted \d+/\d+ \([\d.]+%; lookup \d+/\d+ in \d+ rounds; exit \d+/\d+ "
                     r"in \d+ rounds; \d+ plain "
                     r"steps\), [\d.]+ tokens/round, draft \d+% verify \d+% head \d+% "
                     r"sampling \d+%", result.stderr)


def test_streamed_text_equals_the_json_text(tiny_int4):
    args = ["generate", tiny_int4, "-p", "the quick brown fox", "--max-new-tokens", "16"]
    streamed = run_cli(*args).stdout
    as_json = json.loads(run_cli(*args, "--json").stdout)
    assert streamed.rstrip("\n") == as_json["text"] and as_json["n_generated"] > 0


def test_sampling_with_a_seed_is_reproducible(tiny_int4):
    model = edgespec.load(tiny_int4)
    runs = [model.generate("hello", max_new_tokens=16, temperature=1.0, top_p=0.9, seed=3).tokens
            for _ in range(2)]
    other = model.generate("hello", max_new_tokens=16, temperature=1.0, top_p=0.9, seed=4).tokens
    assert runs[0] == runs[1] and other != runs[0]


def test_the_runtime_works_without_torch_or_transformers(tiny_int4):
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
            "import edgespec\n"
            f"r = edgespec.load({str(tiny_int4)!r}).generate('hi', max_new_tokens=4)\n"
            "print(r.n_generated)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 0


def test_a_prompt_longer_than_the_context_is_refused(tiny_checkpoint, tmp_path):
    export_model(str(tiny_checkpoint), tmp_path / "small", max_context=32, log=quiet)
    result = run_cli("generate", tmp_path / "small", "-p", "fox " * 40)
    assert result.returncode == 2
    assert "context is 32; shorten the prompt" in one_error_line(result.stderr)


@pytest.mark.parametrize("position", [0, -1])
def test_a_token_id_outside_the_vocabulary_is_refused(tiny_int4, position):
    model = edgespec.load(tiny_int4)
    vocab = model.engine.vocab_size
    for bad in (vocab, -1):
        ids = [5, 6, 7]
        ids[position] = bad
        with pytest.raises(EdgespecError, match=f"token id {bad}; this model's ids are "
                                                f"0..{vocab - 1}"):
            model.generate_ids(ids, max_new_tokens=4)
    assert model.generate_ids([5, 6, 7], max_new_tokens=4).n_generated >= 1  # still usable


def test_a_full_context_stops_the_reply_without_a_crash(tiny_checkpoint, tmp_path):
    export_model(str(tiny_checkpoint), tmp_path / "small", max_context=32, log=quiet)
    model = edgespec.load(tmp_path / "small")
    model.stop_ids = set()
    result = model.generate_ids(list(range(5, 25)), max_new_tokens=50)
    assert result.finish_reason == "context_full"
    assert result.n_prompt + result.n_generated == 33  # the last token needs no cache room


@pytest.mark.parametrize("flag, value, name", [
    ("--temperature", "-1", "temperature"), ("--top-p", "1.5", "top-p"),
    ("--top-p", "0", "top-p"), ("--min-p", "2", "min-p"), ("--top-k", "-3", "top-k"),
    ("--repetition-penalty", "0", "repetition-penalty"), ("--max-new-tokens", "0",
                                                          "max-new-tokens"),
    ("--draft-k", "-1", "draft-k"), ("--draft-threshold", "-0.1", "draft-threshold"),
])
def test_invalid_sampling_values_are_one_line_errors(tiny_int4, flag, value, name):
    result = run_cli("generate", tiny_int4, "-p", "hi", flag, value)
    assert result.returncode == 2
    assert f"invalid {name}" in one_error_line(result.stderr)


@pytest.mark.parametrize("flag", ["-p", "--system"])
def test_command_line_text_that_is_not_utf8_is_a_one_line_error(tiny_int4, flag):
    not_utf8 = os.fsdecode(b"caf\xe9")  # "café" in Latin-1: passed on as the byte 0xe9
    args = ["-p", "hi", "--system", "be brief"]
    args[args.index(flag) + 1] = not_utf8
    result = run_cli("generate", tiny_int4, *args)
    assert result.returncode == 2
    assert "is not valid UTF-8 (byte 0xe9 at character 3)" in one_error_line(result.stderr)


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
@pytest.mark.parametrize("threads", ["0", "-3"])
def test_threads_below_one_are_refused(tiny_int4, command, threads):
    result = run_cli(command, tiny_int4, "-p", "hi", "--threads", threads) \
        if command == "generate" else run_cli(command, tiny_int4, "--threads", threads)
    assert result.returncode == 2
    assert f"--threads: {threads} is not a positive integer: it must be >= 1" in result.stderr
