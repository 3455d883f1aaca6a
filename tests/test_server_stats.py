"""What `edgespec serve` tells about each reply (usage.edgespec) and about itself (/metrics)."""
import http.client
import re

import openai
import pytest
from helpers import (chat_body, exchange, open_stream, request_bytes, start_server, stop_server,
                     wait_idle)


@pytest.fixture(scope="module")
def server(long_artifact):
    # one place: the second request waits in the queue
    process, port = start_server(long_artifact, "--parallel", "1", "--queue", "2",
                                 "--allow-ignore-eos")
    yield port
    stop_server(process)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused",
                         timeout=30, max_retries=0)


# ignore_eos: every reply runs to max_tokens, whenever the random model would end its turn
ASK = dict(model="art", temperature=0, extra_body={"ignore_eos": True},
           messages=[{"role": "user", "content": "the quick brown fox"}])


def assert_accounts_for_every_token(numbers, completion_tokens):
    """The first token comes from the prompt's logits; each round then commits its accepted
    drafts and the verifier's own token."""
    assert numbers["mode"] == "speculative" and numbers["rounds"] >= 1
    assert 0 <= numbers["accepted"] <= numbers["drafted"]
    assert completion_tokens == 1 + numbers["rounds"] + numbers["accepted"]
    assert numbers["accepted_per_round"] == pytest.approx(
        numbers["accepted"] / numbers["rounds"], abs=1e-4)
    assert numbers["tokens_per_round"] == pytest.approx(numbers["accepted_per_round"] + 1,
                                                        abs=1e-4)
    assert numbers["tokens_per_s"] > 0 and numbers["decode_s"] > 0


def test_a_reply_reports_what_speculation_did_in_its_usage(client):
    reply = client.chat.completions.create(max_tokens=24, **ASK)
    assert reply.usage.completion_tokens == 24
    assert_accounts_for_every_token(reply.usage.edgespec, 24)


def test_the_last_streamed_chunk_reports_it_too(client):
    chunks = list(client.chat.completions.create(
        max_tokens=24, stream=True, stream_options={"include_usage": True}, **ASK))
    assert not chunks[-1].choices
    assert_accounts_for_every_token(chunks[-1].usage.edgespec, 24)
    assert all(c.usage is None for c in chunks[:-1])


def test_a_reply_cut_by_a_stop_string_still_reports_its_numbers(client):
    full = client.chat.completions.create(max_tokens=40, **ASK).choices[0].message.content
    assert len(full) >= 6, f"the reply {full!r} is too short to cut"
    reply = client.chat.completions.create(max_tokens=40, stop=[full[3:6]], **ASK)
    assert reply.choices[0].finish_reason == "stop"
    numbers = reply.usage.edgespec
    assert numbers["mode"] == "speculative" and numbers["rounds"] >= 1
    # the round that met the stop string may have committed tokens the reply did not keep
    assert 1 <= reply.usage.completion_tokens <= 1 + numbers["rounds"] + numbers["accepted"]


def test_plain_mode_drafts_nothing_and_says_the_same(client):
    speculative = client.chat.completions.create(max_tokens=20, **ASK)
    plain = client.chat.completions.create(max_tokens=20, extra_body={
        "ignore_eos": True, "mode": "plain"}, **{k: v for k, v in ASK.items()
                                                 if k != "extra_body"})
    assert plain.choices[0].message.content == speculative.choices[0].message.content
    numbers = plain.usage.edgespec
    assert numbers["mode"] == "plain" and numbers["tokens_per_s"] > 0
    assert numbers["drafted"] == numbers["accepted"] == 0 and numbers["drafters"] == {}
    assert numbers["tokens_per_round"] == 1  # every round a plain step


def test_an_unknown_mode_is_a_400(client):
    with pytest.raises(openai.BadRequestError,
                       match="invalid mode 'turbo': it must be one of speculative, plain"):
        client.chat.completions.create(max_tokens=4, extra_body={"mode": "turbo"},
                                       **{k: v for k, v in ASK.items() if k != "extra_body"})


def test_a_second_turn_reports_the_prompt_tokens_it_found_in_the_cache(client):
    first = client.chat.completions.create(max_tokens=8, **ASK)
    turn = ASK["messages"] + [{"role": "assistant",
                               "content": first.choices[0].message.content},
                              {"role": "user", "content": "and then?"}]
    second = client.chat.completions.create(max_tokens=8, **{**ASK, "messages": turn})
    cached = second.usage.edgespec["cached_prompt_tokens"]
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens


# -- /metrics ---------------------------------------------------------------------------------

SAMPLE = re.compile(r'^([a-z_]+)(\{[a-z_]+="[^"]*"\})? (-?[0-9.e+-]+|\+Inf)$')


def metrics(port) -> dict:
    """/metrics parsed: 'name' or 'name{label="value"}' -> value. Every line must be a
    comment or a sample in the text format, and every family must say its TYPE."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/metrics")
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type").startswith("text/plain; version=0.0.4")
    values, typed = {}, set()
    for line in response.read().decode().splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:]
            assert kind in ("counter", "gauge", "histogram")
            typed.add(name)
            continue
        if line.startswith("# HELP "):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a Prometheus sample: {line!r}"
        family = re.sub(r"_(bucket|sum|count)$", "", match[1])
        assert match[1] in typed or family in typed, f"{line!r} has no TYPE line"
        values[match[1] + (match[2] or "")] = float(match[3])
    return values


def grew(before, after, name):
    return after.get(name, 0) - before.get(name, 0)


def test_metrics_count_requests_tokens_and_speculation(server, client):
    before = metrics(server)
    reply = client.chat.completions.create(max_tokens=16, **ASK)
    status, _, _ = exchange(server, request_bytes(chat_body(temperature=-1)))
    assert status == 400
    after = metrics(server)
    numbers = reply.usage.edgespec
    assert grew(before, after, 'edgespec_requests_total{code="200"}') >= 2  # + a /metrics
    assert grew(before, after, 'edgespec_requests_total{code="400"}') == 1
    assert grew(before, after, 'edgespec_generations_total{finish="length"}') == 1
    assert grew(before, after, "edgespec_generated_tokens_total") == 16
    assert grew(before, after, "edgespec_prompt_tokens_total") == reply.usage.prompt_tokens
    assert grew(before, after, "edgespec_decode_tokens_total") == 15
    assert grew(before, after, "edgespec_drafted_tokens_total") == numbers["drafted"]
    assert grew(before, after, "edgespec_accepted_tokens_total") == numbers["accepted"]
    assert grew(before, after, "edgespec_speculative_rounds_total") == numbers["rounds"]
    for histogram in ("request_duration_seconds", "time_to_first_token_seconds",
                      "decode_tokens_per_second"):
        assert grew(before, after, f"edgespec_{histogram}_count") == 1
        assert after[f'edgespec_{histogram}_bucket{{le="+Inf"}}'] == \
            after[f"edgespec_{histogram}_count"]
    seconds = grew(before, after, "edgespec_decode_seconds_total")
    assert seconds == pytest.approx(numbers["decode_s"], abs=1e-3)


def test_metrics_show_the_queue_and_count_a_cancelled_generation(server):
    wait_idle(server)
    before = metrics(server)
    running, seen = open_stream(server)
    while seen.count(b'"content": "') < 4:  # the role chunk, then three pieces of text
        seen += running.recv(4096)
    waiting, _ = open_stream(server)
    during = metrics(server)
    assert during["edgespec_busy"] == 1 and during["edgespec_queue_depth"] == 1
    assert during["edgespec_queue_capacity"] == 2
    waiting.close()
    running.close()
    wait_idle(server)
    after = metrics(server)
    assert grew(before, after, 'edgespec_generations_total{finish="cancelled"}') == 2
    assert after["edgespec_busy"] == 0 and after["edgespec_queue_depth"] == 0
    # the running one had generated tokens before its client left: they are counted
    assert grew(before, after, "edgespec_generated_tokens_total") >= 3
    assert grew(before, after, "edgespec_speculative_rounds_total") >= 2


def test_the_metrics_page_is_plain_text_that_names_its_families(server):
    families = {re.sub(r"\{.*", "", name) for name in metrics(server)}
    for name in ("edgespec_requests_total", "edgespec_request_duration_seconds_bucket",
                 "edgespec_decode_tokens_per_second_sum", "edgespec_accepted_tokens_total",
                 "edgespec_queue_depth"):
        assert name in families
