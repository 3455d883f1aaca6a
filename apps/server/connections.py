"""What one client may hold of the server: its key, its connection, its body, its silence.

With an API key set, a request must carry it as a bearer token before anything else is
read; a body is read only when framed by one plain Content-Length within the limit; a
connection whose client stays silent past the timeout is closed; at most so many
connections (one thread each) are open, and one more is answered 503 from the accept loop
and closed.
"""
import contextlib
import hmac
import json
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

from edgespec.errors import EdgespecError

from . import openai_api as api

RETRY_AFTER_S = 2
LINGER_S = 2  # how long a refused body may go on arriving before the connection closes


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    client_timeout_s: float = 30.0  # silence allowed while a request or the next one arrives
    max_connections: int = 64

    def __post_init__(self):
        for flag, value in (("--max-body-bytes", self.max_body_bytes),
                            ("--client-timeout", self.client_timeout_s),
                            ("--max-connections", self.max_connections)):
            if not value > 0:
                raise EdgespecError(f"invalid {flag} {value}: it must be > 0")


class Refused(Exception):
    """A request answered with `status` (and `headers`) before (or instead of) reading its
    body; the connection closes after the answer."""

    def __init__(self, status, message, body_unread=True, headers=None):
        super().__init__(message)
        self.status, self.body_unread, self.headers = status, body_unread, headers or {}


def check_api_key(key: str) -> str:
    """The key as given, if it can travel in an Authorization header."""
    if not (key.isascii() and key.isprintable() and key.strip() == key and " " not in key):
        raise EdgespecError("the API key must be printable ASCII without spaces (it travels "
                            "in an HTTP header); choose another --api-key / EDGESPEC_API_KEY")
    return key


def require_key(headers, key: str, body_unread: bool):
    """Refused (401) unless the request carries `Authorization: Bearer KEY`."""
    scheme, _, token = (headers.get("Authorization") or "").strip().partition(" ")
    # compared in constant time, so the answer's timing does not spell the key out
    if scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), key.encode()):
        return
    challenge = 'Bearer realm="edgespec"' + (', error="invalid_token"' if token else "")
    raise Refused(401, "a valid API key is needed: send it as 'Authorization: Bearer KEY'"
                  if not token else "the API key is not valid",
                  body_unread, {"WWW-Authenticate": challenge})


def read_body(headers, rfile, limits: Limits) -> bytes:
    """The body, framed by one plain Content-Length within the limit (else Refused)."""
    if "Transfer-Encoding" in headers:
        raise Refused(411, "chunked bodies are not read here; send a Content-Length")
    lengths = set(headers.get_all("Content-Length") or [])
    if not lengths:
        raise Refused(411, "a POST needs a Content-Length")
    text = lengths.pop()
    if lengths or not (text.isascii() and text.isdigit()):
        raise Refused(400, f"invalid Content-Length {headers['Content-Length']!r}: send one, "
                      "in decimal digits")
    if len(text) > 18 or int(text) > limits.max_body_bytes:
        raise Refused(413, f"the body has {text} bytes; this server reads at most "
                      f"{limits.max_body_bytes} bytes (its --max-body-bytes)")
    try:
        raw = rfile.read(int(text))
    except TimeoutError:
        raise Refused(408, f"the body did not arrive within {limits.client_timeout_s} s",
                      body_unread=False) from None
    if len(raw) < int(text):
        raise ConnectionError("the client closed the connection mid-body")
    return raw


def linger(connection: socket.socket):
    """After refusing a body: read and drop what still arrives, for a moment, before the
    connection closes (closing on unread data resets it before the client reads the
    answer)."""
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + LINGER_S
        while time.monotonic() < deadline:
            connection.settimeout(deadline - time.monotonic())
            if not connection.recv(1 << 16):
                return


def client_gone(connection: socket.socket) -> bool:
    """True when the peer closed its end (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class Server(ThreadingHTTPServer):
    """One thread per connection, at most `max_connections` of them."""
    daemon_threads = True
    block_on_close = False  # a handler stuck on its client must not hold up shutdown

    def __init__(self, address, handler, max_connections, on_turn_away=lambda: None):
        self.max_connections, self.on_turn_away = max_connections, on_turn_away
        self.slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            self.on_turn_away()
            self._turn_away(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def _turn_away(self, request: socket.socket):
        """503 on a connection over the limit, sent from the accept loop without waiting."""
        body = json.dumps(api.error_body(
            f"the server has {self.max_connections} open connections, its limit "
            "(--max-connections); retry later", "server_busy")).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: {RETRY_AFTER_S}\r\n"
                "Connection: close\r\n\r\n")
        with contextlib.suppress(OSError):
            request.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                request.recv(1 << 16)  # what it sent already: closing on it would reset
            request.send(head.encode() + body)

    def handle_error(self, request, client_address):
        """A client that hangs up is routine; anything else is printed."""
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)
