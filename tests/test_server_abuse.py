"""`edgespec serve` under abuse, on loopback: connections that hold slots without finishing
a request, requests built to burn CPU, and raw HTTP that older servers answer badly. Every
attack leaves a real client served."""
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
from helpers import chat_body, exchange, read_response, request_bytes, start_server, stop_server

KEY = "sk-abuse-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CLIENT_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def keyed(tiny_int4):
    """A server with an API key and the default connection limits."""
    process, port = start_server(tiny_int4, "--api-key", KEY, "--parallel", "2")
    yield SimpleNamespace(process=process, port=port)
    stop_server(process)


@pytest.fixture(scope="module")
def small(long_artifact):
    """A server that holds few connections, with a short client timeout."""
    process, port = start_server(long_artifact, "--api-key", KEY, "--parallel", "2",
                                 "--max-connections", "8",
                                 "--max-connections-per-client", "6",
                                 "--client-timeout", str(CLIENT_TIMEOUT_S))
    yield SimpleNamespace(process=process, port=port)
    stop_server(process)


@pytest.fixture(scope="module")
def tight(long_artifact):
    """A server with room for two connections and one queued request."""
    process, port = start_server(long_artifact, "--parallel", "2", "--queue", "1",
                                 "--allow-ignore-eos", "--max-connections", "2")
    yield SimpleNamespace(process=process, port=port)
    stop_server(process)


def post(port, body: bytes, timeout=10, **fields):
    """An authenticated chat request on a new connection: (status, headers, JSON answer)."""
    headers = {"Host": "x", "Content-Length": str(len(body)), **AUTH}
    status, head, answer = exchange(port, request_bytes(body, headers=headers), timeout)
    return status, head, json.loads(answer)


def connect(port, source="127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))


def closed_by_server(sock, wait_s=0.0) -> bool:
    """True when the server has closed this connection (EOF or reset) within wait_s."""
    sock.settimeout(wait_s or 0.01)
    try:
        return sock.recv(1 << 16) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def metric(port, line_start: str) -> float:
    status, _, text = exchange(port, request_bytes(b"", "/metrics", "GET", {"Host": "x", **AUTH}))
    assert status == 200
    lines = [line for line in text.decode().splitlines() if line.startswith(line_start)]
    return float(lines[0].split()[-1]) if lines else 0.0


class Slowloris:
    """Connections that send a request's head one header line at a time, never ending it."""

    def __init__(self, port, count, every_s):
        self.socks = []
        for _ in range(count):
            sock = connect(port)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            self.socks.append(sock)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, args=(every_s,), daemon=True)
        self.thread.start()

    def _trickle(self, every_s):
        while not self.stop.wait(every_s):
            for sock in self.socks:
                try:
                    sock.sendall(b"X-Slow: 1\r\n")
                except OSError:  # closed by the server
                    pass

    def close(self):
        self.stop.set()
        self.thread.join()
        for sock in self.socks:
            sock.close()


# -- connections ----------------------------------------------------------------------------

def test_a_request_is_answered_at_once_past_200_idle_and_70_slowloris_connections(keyed):
    idle = []
    for _ in range(200):  # accepted one by one, each taking a place
        idle.append(connect(keyed.port))
        time.sleep(0.01)
    slow = Slowloris(keyed.port, 70, every_s=1)
    try:
        started = time.monotonic()
        status, _, answer = post(keyed.port, chat_body("hello", max_tokens=4))
        assert status == 200, answer
        assert time.monotonic() - started < 2
        assert metric(keyed.port, "edgespec_open_connections") <= 64
    finally:
        slow.close()
        for sock in idle:
            sock.close()


def test_a_request_trickled_a_line_at_a_time_is_closed_at_the_client_timeout(small):
    slow = Slowloris(small.port, 1, every_s=0.5)
    try:
        started = time.monotonic()
        sock = slow.socks[0]
        sock.settimeout(CLIENT_TIMEOUT_S + 5)
        answer = sock.makefile("rb").read()  # until the server closes
        assert time.monotonic() - started < CLIENT_TIMEOUT_S + 2
        assert answer.startswith(b"HTTP/1.1 408 ")
    finally:
        slow.close()


def test_connections_closed_for_time_are_counted_in_metrics(small):
    before = metric(small.port, 'edgespec_connections_closed_total{reason="timeout"}')
    with connect(small.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        sock.makefile("rb").read()  # until the server closes
    assert metric(small.port, 'edgespec_connections_closed_total{reason="timeout"}') >= before + 1


def test_a_new_connection_takes_the_place_of_the_longest_waiting_one(small):
    held = [connect(small.port) for _ in range(6)]  # this address's limit
    time.sleep(0.2)
    status, _, answer = post(small.port, chat_body("hello", max_tokens=2))
    assert status == 200, answer
    assert closed_by_server(held[0], 2)
    assert not any(closed_by_server(sock) for sock in held[2:])
    for sock in held:
        sock.close()


def test_one_address_flooding_closes_its_own_connections_not_another_clients(small):
    other = [connect(small.port, "127.0.0.2") for _ in range(2)]
    time.sleep(0.2)
    flood = [connect(small.port, "127.0.0.3") for _ in range(30)]
    time.sleep(0.5)
    assert not any(closed_by_server(sock) for sock in other)
    assert sum(closed_by_server(sock) for sock in flood) >= 24
    status, _, answer = post(small.port, chat_body("hello", max_tokens=2))
    assert status == 200, answer
    for sock in other + flood:
        sock.close()


def test_a_connection_is_answered_503_only_when_every_place_is_busy_answering(tight):
    running = connect(tight.port)
    running.sendall(request_bytes(chat_body("go", max_tokens=4000, ignore_eos=True,
                                            stream=True)))
    running.recv(4096)
    queued = connect(tight.port)
    queued.sendall(request_bytes(chat_body("go", max_tokens=4000, ignore_eos=True)))
    time.sleep(0.5)  # read and queued: both sequences now answer a request
    with connect(tight.port) as over:
        status, head, body = read_response(over.makefile("rb"))
    assert status == 503 and head["retry-after"]
    assert "busy" in json.loads(body)["error"]["message"]
    running.close()
    queued.close()


# -- the request line and headers --------------------------------------------------------------

def test_an_http_0_9_request_is_refused_with_a_full_http_1_1_answer(keyed):
    with connect(keyed.port) as sock:
        sock.sendall(b"GET /\r\n")
        status_line = sock.makefile("rb").readline()
    assert status_line.startswith(b"HTTP/1.1 400 ")


def test_the_server_header_names_edgespec_alone(keyed):
    _, head, _ = exchange(keyed.port, request_bytes(b"", "/health", "GET", {"Host": "x"}))
    assert head["server"] == "edgespec"


def test_headers_over_the_budget_are_refused_with_431(keyed):
    headers = {"Host": "x", **{f"X-Big-{i}": "a" * 60_000 for i in range(90)}}
    with connect(keyed.port) as sock:
        try:
            sock.sendall(request_bytes(b"", "/health", "GET", headers))
        except (BrokenPipeError, ConnectionResetError):  # closed before all of it was sent
            pass
        status, _, body = read_response(sock.makefile("rb"))
    assert status == 431 and "bytes" in json.loads(body)["error"]["message"]


# -- request bodies ----------------------------------------------------------------------------

def test_four_200k_character_stops_are_refused_at_once(keyed):
    started = time.monotonic()
    status, _, answer = post(keyed.port, chat_body(stop=["ab" * 100_000] * 4))
    assert status == 400 and answer["error"]["param"] == "stop"
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("field, value", [
    ("top_p", 2.0), ("min_p", -0.5), ("top_k", -3), ("repetition_penalty", 0.0),
    ("presence_penalty", 9.0), ("temperature", -1.0), ("seed", -1)])
def test_an_out_of_range_sampling_field_is_named_in_the_400(keyed, field, value):
    status, _, answer = post(keyed.port, chat_body(**{field: value}))
    assert status == 400 and answer["error"]["param"] == field


@pytest.mark.parametrize("field, value", [
    ("logprobs", True), ("top_logprobs", 3), ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"), ("logit_bias", {"50": 10})])
def test_a_field_this_server_does_not_implement_is_a_400_naming_it(keyed, field, value):
    status, _, answer = post(keyed.port, chat_body(**{field: value}))
    assert status == 400 and answer["error"]["param"] == field
    assert "not supported" in answer["error"]["message"]


@pytest.mark.parametrize("field, value", [
    ("logprobs", False), ("response_format", {"type": "text"}), ("tools", []),
    ("logit_bias", {})])
def test_a_field_that_asks_for_nothing_is_accepted(keyed, field, value):
    status, _, answer = post(keyed.port, chat_body(**{field: value}))
    assert status == 200, answer
