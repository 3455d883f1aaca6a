"""`edgespec serve` on loopback, driven by the official openai client and by raw sockets."""
import http.client
import json
import socket

import openai
import pytest
from helpers import open_stream, start_server, stop_server, wait_busy, wait_idle

from edgespec.tokenizer import TextCodec


@pytest.fixture(scope="module")
def server(long_artifact):
    process, port = start_server(long_artifact, "--parallel", "1", "--queue", "1",
                                 "--allow-ignore-eos")
    yield port
    stop_server(process)


def openai_client(port):
    # a short timeout and no retries: a request the server never answers fails the test
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         timeout=30, max_retries=0)


@pytest.fixture
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def default_server(tiny_int4):
    """A server started without options."""
    process, port = start_server(tiny_int4)
    yield port
    stop_server(process)


def test_models_lists_the_artifact(client):
    assert [m.id for m in client.models.list().data] == ["art"]


def test_chat_completion_with_usage(client):
    reply = client.chat.completions.create(model="art", max_tokens=12, temperature=0,
                                           messages=[{"role": "user", "content": "hello"}])
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 12 and reply.usage.prompt_tokens > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streaming_chat_equals_the_non_streaming_reply(client):
    args = dict(model="art", max_tokens=20, temperature=0, seed=1,
                messages=[{"role": "user", "content": "the quick brown fox"}])
    whole = client.chat.completions.create(**args).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **args))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_completions_streaming_and_not(client):
    whole = client.completions.create(model="art", prompt="hello world", max_tokens=10,
                                      temperature=0)
    streamed = client.completions.create(model="art", prompt="hello world", max_tokens=10,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text
    assert whole.usage.completion_tokens <= 10


def test_a_stop_string_ends_the_reply(client):
    # ignore_eos: all 40 tokens come, whenever the random model would end its turn
    args = dict(model="art", max_tokens=40, temperature=0, extra_body={"ignore_eos": True},
                messages=[{"role": "user", "content": "count with me"}])
    full = client.chat.completions.create(**args).choices[0].message.content
    assert len(full) >= 6, f"the reply {full!r} is too short to cut"
    stop = full[3:6]
    cut = client.chat.completions.create(stop=[stop], **args).choices[0]
    assert cut.message.content == full[:full.index(stop)] and cut.finish_reason == "stop"


@pytest.mark.parametrize("args, param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=1.5), "top_p"), (dict(n=2), "n"),
    (dict(max_tokens=0), "max_tokens"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(max_completion_tokens=0), "max_completion_tokens"), (dict(seed=-1), "seed"),
    (dict(seed=2**63), "seed"),
])
def test_bad_parameters_are_400_errors(client, args, param):
    with pytest.raises(openai.BadRequestError, match=param.replace("_", "[-_]")):
        client.chat.completions.create(model="art", messages=[{"role": "user", "content": "x"}],
                                       **args)


def test_max_tokens_beyond_the_context_is_cut_to_the_room_the_prompt_leaves(client,
                                                                           long_artifact):
    codec, words = TextCodec(long_artifact), "the quick brown fox jumps over the lazy dog "
    per_repeat = len(codec.encode(words * 2)) - len(codec.encode(words))
    prompt = words * (4000 // per_repeat)
    room = 4096 - len(codec.encode(prompt))
    assert 0 < room < 200
    reply = client.completions.create(model="art", prompt=prompt, max_tokens=10**9,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == room and reply.usage.total_tokens == 4096
    assert reply.choices[0].finish_reason == "length"


def test_ignore_eos_is_refused_unless_the_server_allows_it(default_server):
    with pytest.raises(openai.BadRequestError, match="ignore_eos.*--allow-ignore-eos"):
        openai_client(default_server).chat.completions.create(
            model="art", max_tokens=4, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": "x"}])


def test_malformed_bodies_are_400_errors(server):
    for body in (b"{not json", b'{"messages": "hi"}', b"[1, 2]"):
        conn = http.client.HTTPConnection("127.0.0.1", server, timeout=5)
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 400 and "error" in json.loads(response.read())


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_generation(server, stream):
    before = wait_idle(server)
    if stream:
        sock, first = open_stream(server)
        assert first.startswith(b"HTTP/1.1 200")
    else:
        sock = socket.create_connection(("127.0.0.1", server))
        body = json.dumps({"model": "art", "max_tokens": 4000, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "go"}]})
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     f"{len(body)}\r\n\r\n{body}".encode())
        wait_busy(server)
    sock.close()
    after = wait_idle(server)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]  # stopped, not run to the end


def test_a_full_queue_answers_503_with_retry_after(server):
    wait_idle(server)
    # one request runs, one waits in the queue of one, the rest arrive within milliseconds
    streams = [open_stream(server)]
    wait_busy(server)  # the worker has taken the first request
    streams += [open_stream(server) for _ in range(5)]
    statuses = [first.split(b"\r\n", 1)[0] for _, first in streams]
    assert statuses[:2] == [b"HTTP/1.1 200 OK"] * 2
    assert b"HTTP/1.1 503 Service Unavailable" in statuses[2:]
    sock, busy = next((sock, first) for sock, first in streams if b" 503 " in first)
    while not busy.endswith(b"}"):  # the JSON body may come after the headers
        busy += sock.recv(4096)
    assert b"Retry-After: 2\r\n" in busy and b'"server_busy"' in busy
    for sock, _ in streams:
        sock.close()
    wait_idle(server)
