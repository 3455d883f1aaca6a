"""`edgespec serve --parallel N`: replies decoded together, each equal to its solo reply;
sequences freed by cancelled and dropped clients; arrival order; isolation between keys; the
memory the sequences hold; no stall while a long prompt arrives."""
import json
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from helpers import (exchange, free_port, health, one_error_line, open_stream, request_bytes,
                     run_cli, server_log, start_server, stop_server, wait_for, wait_idle)

import edgespec
from edgespec.apps.server import capacity
from edgespec.errors import EdgespecError

KEYS = ("sk-first-client", "sk-second-client")
PROMPTS = ["the quick brown fox", "a b c d e f g", "tell me about ducks and geese",
           "1 2 3", "hello there", "one more prompt, a little longer than the others were"]
# ignore_eos: every reply runs to max_tokens, whenever the random model would end its turn
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def lookup_only(tiny_int4, tmp_path_factory):
    """The tiny artifact with its early exit turned off: every draft is lookup's, which
    plans on the text and the measured costs alone, so its counts repeat run to run."""
    path = tmp_path_factory.mktemp("lookup-only") / "art"
    shutil.copytree(tiny_int4, path)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["draft"]["k"] = 0
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.fixture(scope="module")
def server(lookup_only):
    process, port = start_server(lookup_only, "--parallel", "2", "--allow-ignore-eos",
                                 "--api-key", KEYS[0], "--api-key", KEYS[1])
    process.port = port
    yield process
    stop_server(process)


@pytest.fixture(scope="module")
def long_server(long_artifact):
    """Replies slow enough to hold their sequences while a test looks."""
    process, port = start_server(long_artifact, "--parallel", "2", "--allow-ignore-eos",
                                 "--queue", "4")
    yield port
    stop_server(process)


def client(port, key=KEYS[0]):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=60,
                         max_retries=0)


def ask(port, content, max_tokens=24, key=KEYS[0], stream=False, **fields):
    """A chat reply: its text, usage and the times its text chunks arrived."""
    chat = client(port, key).chat.completions.create(
        model="art", max_tokens=max_tokens, stream=stream,
        messages=content if isinstance(content, list) else [{"role": "user", "content": content}],
        **({"stream_options": {"include_usage": True}} if stream else {}), **fields)
    if not stream:
        return {"text": chat.choices[0].message.content, "usage": chat.usage, "times": []}
    text, times, usage = [], [], None
    for chunk in chat:
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            times.append(time.monotonic())
    return {"text": "".join(text), "usage": usage, "times": times}


def together(calls):
    """Run the calls at once; their results in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


def requests_of_every_kind(port):
    """Greedy and seeded replies, streamed and not, of different lengths."""
    return [lambda i=i, prompt=prompt: ask(port, prompt, max_tokens=8 + 7 * i, stream=i % 2 == 1,
                                            **(GREEDY if i % 3 else SAMPLED))
            for i, prompt in enumerate(PROMPTS)]


def test_replies_decoded_together_equal_their_solo_replies(server):
    calls = requests_of_every_kind(server.port)
    solo = [call() for call in calls]
    during = together(calls)  # two run at once, the rest wait for a place
    assert [r["text"] for r in during] == [r["text"] for r in solo]
    assert [r["usage"].completion_tokens for r in during] == \
        [r["usage"].completion_tokens for r in solo]
    assert health(server.port)["parallel"] == 2


def test_the_server_says_what_its_places_hold(server):
    log = server_log(server)
    assert "2 conversations at once, each up to" in log and "MiB of KV cache each" in log


def test_a_second_key_finds_nothing_the_first_one_sent(server):
    port = server.port
    first = ask(port, "tell me about ducks", max_tokens=48, **GREEDY)
    turn = [{"role": "user", "content": "tell me about ducks"},
            {"role": "assistant", "content": first["text"]},
            {"role": "user", "content": "and about geese?"}]
    mine = ask(port, turn, max_tokens=48, **GREEDY)
    other = ask(port, turn, max_tokens=48, key=KEYS[1], **GREEDY)
    assert other["text"] == mine["text"]
    # the first key's next turn runs only its new tokens; the second key's, every token
    assert mine["usage"].edgespec["cached_prompt_tokens"] > 0
    assert other["usage"].edgespec["cached_prompt_tokens"] == 0

    def copied(reply):
        return reply["usage"].edgespec["drafters"]["lookup"]["accepted"]
    # asked again, each key's drafts copy its own earlier reply: the second key's first
    # reply could not copy the first key's
    assert copied(ask(port, turn, max_tokens=48, **GREEDY)) > copied(other)
    assert copied(ask(port, turn, max_tokens=48, key=KEYS[1], **GREEDY)) > copied(other)


def test_a_cancelled_reply_leaves_the_others_unchanged(server):
    calls = requests_of_every_kind(server.port)[:3]
    solo = [call() for call in calls]

    def cancelled():
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        body = json.dumps({"model": "art", "stream": True, "max_tokens": 4000,
                           "ignore_eos": True, "messages": [{"role": "user", "content": "go"}]})
        sock.sendall(request_bytes(body.encode(), headers={
            "Authorization": f"Bearer {KEYS[0]}", "Content-Length": str(len(body))}))
        seen = b""
        while seen.count(b'"content": "') < 4:  # a few rounds beside the others
            seen += sock.recv(4096)
        sock.close()

    during = together([cancelled] + calls)[1:]
    assert [r["text"] for r in during] == [r["text"] for r in solo]


def test_a_dropped_client_frees_its_place_for_the_next_in_line(long_server):
    wait_idle(long_server)
    first, _ = open_stream(long_server)
    second, _ = open_stream(long_server)
    wait_for(long_server, running=2)
    third, _ = open_stream(long_server)  # waits: both sequences are taken
    before = wait_for(long_server, queued=1)["cancelled"]
    first.close()
    deadline = time.monotonic() + 3  # the handler looks every 0.25 s, a round later it is free
    while health(long_server)["queued"]:
        assert time.monotonic() < deadline, "the dropped client's place was not given on"
        time.sleep(0.02)
    state = health(long_server)
    assert state["running"] == 2 and state["cancelled"] == before + 1
    for sock in (second, third):
        sock.close()
    wait_idle(long_server)


def test_requests_take_places_in_arrival_order_and_a_slow_reader_holds_nobody(long_server):
    wait_idle(long_server)
    unread, _ = open_stream(long_server)  # never read again: its socket fills, it stays
    holding, _ = open_stream(long_server)
    wait_for(long_server, running=2)
    finished = {}

    def short(name):
        reply = ask(long_server, "short", max_tokens=4, key="unused", stream=True)
        finished[name] = reply["times"][0]

    with ThreadPoolExecutor(2) as pool:
        early = pool.submit(short, "early")
        wait_for(long_server, queued=1)
        late = pool.submit(short, "late")
        wait_for(long_server, queued=2)
        holding.close()  # one place frees: the early request takes it, then the late one
        early.result(timeout=30)
        late.result(timeout=30)
    assert finished["early"] < finished["late"]
    unread.close()
    wait_idle(long_server)


def test_metrics_show_the_running_sequences_and_the_batch_rates(long_server):
    wait_idle(long_server)
    streams = [open_stream(long_server)[0] for _ in range(2)]
    wait_for(long_server, running=2)
    before = metrics(long_server)
    time.sleep(0.5)
    after = metrics(long_server)
    assert after["edgespec_sequences_running"] == 2 and after["edgespec_parallel"] == 2
    assert after["edgespec_tokens_per_second"] > 0 and after["edgespec_rows_per_round"] > 0
    rounds = after["edgespec_decoding_rounds_total"] - before["edgespec_decoding_rounds_total"]
    rows = after["edgespec_round_rows_total"] - before["edgespec_round_rows_total"]
    assert rounds > 0 and rows >= 2 * rounds  # both replies in every round
    for sock in streams:
        sock.close()
    wait_idle(long_server)


def metrics(port) -> dict:
    status, _, body = exchange(port, request_bytes(b"", method="GET", path="/metrics",
                                                   headers={}))
    assert status == 200
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in
            body.decode().splitlines() if not line.startswith("#"))}


def test_a_long_prompt_arriving_does_not_stall_the_streams_running(long_artifact):
    process, port = start_server(long_artifact, "--parallel", "4", "--allow-ignore-eos")
    try:
        long_prompt = " ".join(["word"] * 2000)
        started = time.monotonic()

        def arriving():
            time.sleep(1.0)  # the three streams are under way
            return ask(port, long_prompt, max_tokens=4, key="unused", **GREEDY)

        streams = [lambda: ask(port, "go", max_tokens=1200, key="unused", stream=True, **GREEDY)
                   for _ in range(3)]
        results = together([arriving] + streams)
        assert results[0]["usage"].prompt_tokens >= 2000
        for stream in results[1:]:
            gaps = [b - a for a, b in zip(stream["times"], stream["times"][1:])
                    if a > started + 0.5]
            assert stream["times"][-1] > started + 1.5, "the streams ended before it came"
            assert max(gaps) < 0.5
    finally:
        stop_server(process)


# -- the sequences' memory ----------------------------------------------------------------------

def test_places_that_do_not_fit_are_refused_naming_what_would(tiny_int4):
    engine = edgespec.load(tiny_int4).engine
    each = engine.sequence_bytes
    capacity.check_parallel(4, engine, 4 * each)  # fits exactly
    with pytest.raises(EdgespecError) as refused:
        capacity.check_parallel(4, engine, 3 * each)
    message = str(refused.value)
    assert message.startswith(f"--parallel 4 at --max-context {engine.max_context} needs")
    assert "--parallel 3 fits at that context" in message
    shorter = int(message.split("--max-context ")[-1].split()[0])
    assert shorter < engine.max_context and 4 * engine.bytes_for_context(shorter) <= 3 * each


def test_a_shorter_context_holds_less_memory(tiny_int4):
    full = edgespec.load(tiny_int4).engine
    half = edgespec.load(tiny_int4, max_context=full.max_context // 2).engine
    assert half.max_context == full.max_context // 2
    assert half.sequence_bytes < 0.6 * full.sequence_bytes
    assert half.bytes_for_context(full.max_context) == full.sequence_bytes


def test_more_places_than_the_batch_graphs_hold_are_refused_by_the_flag(tiny_int4):
    done = run_cli("serve", tiny_int4, "--port", str(free_port()), "--parallel", "9",
                   timeout=120)
    assert done.returncode == 2 and "argument --parallel: at most 8" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_context_above_the_artifacts_is_refused_at_start(tiny_int4):
    done = run_cli("serve", tiny_int4, "--port", str(free_port()), "--max-context", "100000",
                   timeout=120)
    assert done.returncode != 0
    assert "invalid max context 100000" in one_error_line(done.stderr)
