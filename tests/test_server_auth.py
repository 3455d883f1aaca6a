"""`edgespec serve` left running: an API key, loopback by default, limits named in 4xx."""
import json
import os
import re
from pathlib import Path

import openai
import pytest
from helpers import (chat_body, exchange, one_error_line, request_bytes, run_cli, start_server,
                     stop_server)

KEY = "sk-test-0123456789"
STATIC = Path(__file__).parent.parent / "apps" / "server" / "static"


@pytest.fixture(scope="module")
def keyed(tiny_int4):
    """A server whose key comes from EDGESPEC_API_KEY, with a cap on max_tokens."""
    os.environ["EDGESPEC_API_KEY"] = KEY
    try:
        process, port = start_server(tiny_int4, "--max-tokens", "8")
    finally:
        del os.environ["EDGESPEC_API_KEY"]
    yield port
    stop_server(process)


def client(port, key):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, timeout=30,
                         max_retries=0)


def get(port, path, headers=None):
    return exchange(port, request_bytes(b"", method="GET", path=path, headers=headers or {}))


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


# -- the key ---------------------------------------------------------------------------------

def test_the_api_answers_with_the_right_key(keyed):
    reply = client(keyed, KEY).chat.completions.create(
        model="art", max_tokens=4, messages=[{"role": "user", "content": "hello"}])
    assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_post_without_the_key_is_a_401_that_asks_for_a_bearer_token(keyed, path):
    status, head, body = exchange(keyed, request_bytes(chat_body(), path=path))
    assert status == 401 and head["www-authenticate"] == 'Bearer realm="edgespec"'
    assert "Authorization: Bearer" in json.loads(body)["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/models", "/metrics", "/v1/nothing"])
def test_a_get_of_the_api_without_the_key_is_a_401(keyed, path):
    status, head, _ = get(keyed, path)
    assert status == 401 and head["www-authenticate"].startswith("Bearer")


@pytest.mark.parametrize("given", [KEY[:-1], KEY + "0", KEY.upper(), "", "x" * 4000])
def test_a_wrong_key_is_a_401_invalid_token(keyed, given):
    with pytest.raises(openai.AuthenticationError, match="not valid"):
        client(keyed, given or "-").models.list()
    status, head, _ = get(keyed, "/v1/models", bearer(given or "-"))
    assert status == 401 and 'error="invalid_token"' in head["www-authenticate"]


@pytest.mark.parametrize("header", [f"Basic {KEY}", KEY, f"Bearer{KEY}"])
def test_the_key_counts_only_as_a_bearer_token(keyed, header):
    assert get(keyed, "/v1/models", {"Authorization": header})[0] == 401


def test_the_key_is_checked_before_the_body_is_read(keyed):
    # an unauthenticated client cannot make the server take in a body, whatever its size
    raw = request_bytes(b"", headers={"Content-Length": str(10**9)})
    status, head, _ = exchange(keyed, raw)
    assert status == 401 and head["connection"] == "close"


@pytest.mark.parametrize("path", ["/", "/chat.js", "/chat.css", "/health"])
def test_the_page_and_health_are_open_without_the_key(keyed, path):
    assert get(keyed, path)[0] == 200


def test_metrics_answer_with_the_key(keyed):
    status, head, body = get(keyed, "/metrics", bearer(KEY))
    assert status == 200 and b'edgespec_requests_total{code="401"}' in body


def test_the_command_line_key_wins_over_the_environment(tiny_int4):
    os.environ["EDGESPEC_API_KEY"] = "from-the-environment"
    try:
        process, port = start_server(tiny_int4, "--api-key", KEY)
    finally:
        del os.environ["EDGESPEC_API_KEY"]
    try:
        assert get(port, "/v1/models", bearer(KEY))[0] == 200
        assert get(port, "/v1/models", bearer("from-the-environment"))[0] == 401
    finally:
        stop_server(process)


@pytest.mark.parametrize("key", ["two words", "caf\u00e9", "tab\there"])
def test_a_key_that_cannot_travel_in_a_header_is_refused_at_start(tiny_int4, key):
    done = run_cli("serve", tiny_int4, "--api-key", key, "--port", "0", timeout=120)
    assert done.returncode != 0
    assert "API key must be printable ASCII" in one_error_line(done.stderr)


# -- where it listens, and limits ----------------------------------------------------------

def listening_addresses(port) -> set:
    """Local addresses of the sockets listening on `port` (Linux /proc, IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, _, state = line.split()[1:4]
            address, hex_port = local.split(":")
            if int(hex_port, 16) == port and state == "0A":  # 0A: LISTEN
                found.add(address)
    return found


def test_the_server_listens_on_loopback_only_by_default(keyed):
    assert listening_addresses(keyed) == {"0100007F"}  # 127.0.0.1, little-endian hex


def test_max_tokens_above_the_servers_limit_is_a_400_that_names_it(keyed):
    with pytest.raises(openai.BadRequestError, match=r"max_tokens 9 .* limit of 8 .*--max-tokens"):
        client(keyed, KEY).chat.completions.create(
            model="art", max_tokens=9, messages=[{"role": "user", "content": "x"}])


def test_a_request_without_max_tokens_gets_the_servers_limit(keyed):
    reply = client(keyed, KEY).completions.create(model="art", prompt="hello world",
                                                  temperature=0, max_tokens=None)
    assert 1 <= reply.usage.completion_tokens <= 8


def test_a_prompt_longer_than_the_context_is_a_400_that_names_both(keyed):
    with pytest.raises(openai.BadRequestError, match=r"the prompt has \d+ tokens; the context "
                       r"is 512"):
        client(keyed, KEY).completions.create(model="art", prompt="hello world " * 400,
                                              max_tokens=4)


def test_an_empty_queue_is_refused_at_start(tiny_int4):
    done = run_cli("serve", tiny_int4, "--queue", "0", timeout=60)
    assert done.returncode != 0 and "--queue: 0 is not a positive integer" in done.stderr


# -- the page's files ----------------------------------------------------------------------

def test_the_page_is_served_with_headers_that_keep_it_to_itself(keyed):
    status, head, body = get(keyed, "/")
    assert status == 200 and head["content-type"] == "text/html; charset=utf-8"
    assert head["content-security-policy"].startswith("default-src 'self'")
    assert head["x-content-type-options"] == "nosniff" and head["x-frame-options"] == "DENY"
    assert b'<script src="/chat.js"' in body


def test_the_page_loads_nothing_from_elsewhere():
    # the page's own files: vendor/ holds upstream libraries as published, which name sites
    # only in comments and as XML namespaces; the CSP keeps every file to this server
    for path in STATIC.glob("*.*"):
        text = re.sub(r'xmlns="[^"]*"', "", path.read_text())  # a namespace's name, not a load
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text), \
            f"{path.name} refers to another site"


def test_other_paths_and_methods_are_4xx(keyed):
    assert get(keyed, "/../apps/server/server.py")[0] == 401  # not a file: the API's guard
    assert get(keyed, "/static/chat.js", bearer(KEY))[0] == 404
    status, head, _ = exchange(keyed, request_bytes(b"", method="DELETE", path="/v1/models"))
    assert status == 405 and head["allow"] == "GET, HEAD, POST"


def test_head_gives_the_pages_headers_without_its_body(keyed):
    import socket
    with socket.create_connection(("127.0.0.1", keyed), timeout=10) as sock:
        sock.sendall(request_bytes(b"", method="HEAD", path="/", headers={}))
        sock.sendall(request_bytes(b"", method="GET", path="/health", headers={}))
        reader = sock.makefile("rb")
        status = reader.readline()
        head = dict(line.decode().strip().split(": ", 1)
                    for line in iter(reader.readline, b"\r\n"))
        assert b"200" in status and int(head["Content-Length"]) > 0
        # no body came: the next thing on the connection is the answer to the GET
        assert reader.readline().startswith(b"HTTP/1.1 200")
