"""What one client may hold of the server: its key, its connection, its body, its time.

With an API key set, a request must carry it as a bearer token before anything else is
read; a body is read only when framed by one plain Content-Length within the limit. Each
request must arrive whole (head and body) within the client timeout, counted from when the
server is ready for it, and its head within a byte budget: a client that trickles a header
line now and then is closed all the same. Connections are threads, so they are counted:
while a connection waits for its request it may be closed to make room for a new one (the
longest-waiting of the address holding the most), and only when every connection is busy
answering is a new one answered 503 and closed.
"""
import contextlib
import hmac
import io
import json
import select
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import ThreadingHTTPServer

from edgespec.errors import EdgespecError

from . import openai_api as api

RETRY_AFTER_S = 2
LINGER_S = 2  # how long a refused body may go on arriving before the connection closes


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    client_timeout_s: float = 30.0  # for a whole request, from when the server is ready for it
    max_connections: int = 64
    max_connections_per_client: int = 32  # per client address
    max_head_bytes: int = 32 << 10  # request line and headers

    def __post_init__(self):
        for flag, value in (("--max-body-bytes", self.max_body_bytes),
                            ("--client-timeout", self.client_timeout_s),
                            ("--max-connections", self.max_connections),
                            ("--max-connections-per-client",
                             self.max_connections_per_client),
                            ("max_head_bytes", self.max_head_bytes)):
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


def require_key(headers, keys: tuple, body_unread: bool) -> int:
    """Which of the keys the request carries as `Authorization: Bearer KEY`; refused (401)
    when none."""
    scheme, _, token = (headers.get("Authorization") or "").strip().partition(" ")
    # every key compared, each in constant time: the timing does not spell a key out
    matches = [hmac.compare_digest(token.strip().encode(), key.encode()) for key in keys]
    if scheme.lower() == "bearer" and any(matches):
        return matches.index(True)
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
        raise Refused(408, f"the request did not arrive whole within {limits.client_timeout_s}"
                      " s (the server's --client-timeout)", body_unread=False) from None
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


class HeadTooLarge(Exception):
    """A request line and headers over the head budget."""


class RequestReader(io.RawIOBase):
    """A connection's reading side, with a deadline for the request being read: every
    receive waits at most until then, so a client cannot stretch a request by sending a
    byte now and then. `readline` (the request line and headers) also keeps to a byte
    budget; `read` (the body) is framed by Content-Length. Writes keep the socket's own
    timeout."""

    def __init__(self, sock: socket.socket, max_head_bytes: int, on_timeout=lambda: None):
        super().__init__()
        self.sock, self.max_head_bytes, self.on_timeout = sock, max_head_bytes, on_timeout
        self.buffer = io.BufferedReader(self)
        self.deadline, self.head_bytes, self.received, self.timed_out = None, 0, 0, False

    def begin(self, timeout_s: float):
        """A new request: it must arrive whole within timeout_s from now."""
        self.deadline = time.monotonic() + timeout_s
        self.head_bytes = self.received = 0
        self.timed_out = False

    def _time_out(self):
        self.timed_out = True
        self.on_timeout()

    def readable(self):
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self._time_out()
            raise TimeoutError("the request's deadline passed")
        write_timeout = self.sock.gettimeout()
        self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(buffer)
        except TimeoutError:
            self._time_out()
            raise
        finally:
            self.sock.settimeout(write_timeout)
        self.received += n
        return n

    def readline(self, limit=-1) -> bytes:
        room = self.max_head_bytes - self.head_bytes + 1
        line = self.buffer.readline(room if limit < 0 else min(limit, room))
        self.head_bytes += len(line)
        if self.head_bytes > self.max_head_bytes:
            raise HeadTooLarge(f"the request line and headers take more than "
                               f"{self.max_head_bytes} bytes")
        return line

    def read(self, size=-1) -> bytes:
        return self.buffer.read(size)


@dataclass
class Connection:
    address: str
    waiting_since: float  # None while its request is being answered


class Server(ThreadingHTTPServer):
    """One thread per connection, at most `max_connections` of them and
    `max_connections_per_client` per client address. A connection waiting for its request
    makes room for a new one when need be; handlers say when they wait (`waiting`) and when
    their request is whole and being answered (`answering`)."""
    daemon_threads = True
    block_on_close = False  # a handler stuck on its client must not hold up shutdown
    request_queue_size = 256  # a burst of connections waits to be accepted, not refused

    def __init__(self, address, handler, limits: Limits, on_close=lambda reason: None):
        self.limits, self.on_close = limits, on_close
        self.lock = threading.Lock()
        self.open = {}  # socket -> Connection
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._make_room(request, client_address[0]):
            self.on_close("turned_away")
            self._turn_away(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def waiting(self, sock):
        with self.lock:
            if sock in self.open:
                self.open[sock].waiting_since = time.monotonic()

    def answering(self, sock):
        with self.lock:
            if sock in self.open:
                self.open[sock].waiting_since = None

    def open_connections(self) -> int:
        with self.lock:
            return len(self.open)

    def _forget(self, sock):
        with self.lock:
            self.open.pop(sock, None)

    def _make_room(self, sock, address) -> bool:
        """Registers a new connection, closing a waiting one if the limits call for it;
        False when every connection in the way is busy answering."""
        with self.lock:
            per_address = Counter(c.address for c in self.open.values())
            if per_address[address] >= self.limits.max_connections_per_client:
                crowd = {address}
            elif len(self.open) >= self.limits.max_connections:
                most = max(per_address.values())
                crowd = {a for a, n in per_address.items() if n == most}
            else:
                crowd = set()
            if crowd:
                waiting = [(c.waiting_since, s) for s, c in self.open.items()
                           if c.address in crowd and c.waiting_since is not None]
                if not waiting:
                    return False
                _, victim = min(waiting, key=lambda pair: pair[0])
                del self.open[victim]
                with contextlib.suppress(OSError):  # its handler reads b"" and ends
                    victim.shutdown(socket.SHUT_RDWR)
                self.on_close("made_room")
            self.open[sock] = Connection(address, time.monotonic())
            return True

    def _turn_away(self, request: socket.socket):
        """503 on a connection over the limit, sent from the accept loop without waiting."""
        body = json.dumps(api.error_body(
            "every connection this server may hold is busy (--max-connections, "
            "--max-connections-per-client); retry later", "server_busy")).encode()
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
