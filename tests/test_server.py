"""`edgespec serve` on loopback, driven by the official openai client and by raw sockets."""
import http.client
import json
import socket
import subprocess
import sys
import time

import openai
import pytest
from helpers import make_checkpoint, quiet

from export.pipeline import export_model


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def long_artifact(tmp_path_factory):
    """The tiny model with room for 4000-token replies (slow enough to cancel)."""
    path = tmp_path_factory.mktemp("long")
    checkpoint = make_checkpoint(path / "ckpt", max_positions=4096)
    export_model(str(checkpoint), path / "art", max_context=4096, log=quiet)
    return path / "art"


def start_server(artifact, *args):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", str(artifact),
                                "--port", str(port), *args], stderr=subprocess.PIPE, text=True)
    for _ in range(200):
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).request("GET", "/health")
            return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(process.stderr.read())


@pytest.fixture(scope="module")
def server(long_artifact):
    process, port = start_server(long_artifact, "--queue", "1")
    yield port
    process.terminate()
    process.wait(10)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key="unused")


def health(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request("GET", "/health")
    return json.loads(conn.getresponse().read())


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
    args = dict(model="art", max_tokens=40, temperature=0,
                messages=[{"role": "user", "content": "count with me"}])
    full = client.chat.completions.create(**args).choices[0].message.content
    if len(full) < 6:
        pytest.skip("the reply is too short to cut")
    stop = full[3:6]
    cut = client.chat.completions.create(stop=[stop], **args).choices[0]
    assert cut.message.content == full[:full.index(stop)] and cut.finish_reason == "stop"


@pytest.mark.parametrize("args, param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=1.5), "top_p"), (dict(n=2), "n"),
    (dict(max_tokens=0), "max_tokens"), (dict(presence_penalty=0.5), "presence_penalty"),
])
def test_bad_parameters_are_400_errors(client, args, param):
    with pytest.raises(openai.BadRequestError, match=param.replace("_", "[-_]")):
        client.chat.completions.create(model="art", messages=[{"role": "user", "content": "x"}],
                                       **args)


def test_malformed_bodies_are_400_errors(server):
    for body in (b"{not json", b'{"messages": "hi"}', b"[1, 2]"):
        conn = http.client.HTTPConnection("127.0.0.1", server, timeout=5)
        conn.request("POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 400 and "error" in json.loads(response.read())


def open_stream(port, max_tokens=4000):
    """Start a streaming chat request on a raw socket; returns it after the first bytes."""
    sock = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"model": "art", "stream": True, "max_tokens": max_tokens,
                       "ignore_eos": True, "messages": [{"role": "user", "content": "go"}]})
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    return sock, sock.recv(4096)


def wait_idle(port, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = health(port)
        if not state["busy"] and state["queued"] == 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"the server stayed busy: {state}")


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
        while not health(server)["busy"]:
            time.sleep(0.01)
    sock.close()
    after = wait_idle(server)
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["completed"] == before["completed"]  # stopped, not run to the end


def test_a_full_queue_answers_503_with_retry_after(server):
    wait_idle(server)
    # one request runs, one waits in the queue of one, the rest arrive within milliseconds
    streams = [open_stream(server)]
    while not health(server)["busy"]:  # the worker has taken the first request
        time.sleep(0.01)
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
