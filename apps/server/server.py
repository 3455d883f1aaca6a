"""`edgespec serve`: an OpenAI-compatible HTTP server around one engine, and its chat page.

One worker thread owns the model and decodes up to `parallel` requests together, each
round of the batch giving every running reply its next tokens (edgespec/batch.py); a reply
is bit for bit the one it gets alone. Requests beyond those wait in a bounded queue (full:
503 with Retry-After) and take a sequence, in arrival order, as soon as one is free. A
client that disconnects cancels its generation: the handler notices when a write fails or
the socket closes, and its sequence is free after the next round.

Cached prompts and the replies lookup drafting copies from are kept per owner: the API key
a request came with, or its client's address on a server without keys.

No client can stall the others: every job ends with a final event, whatever fails in it;
every request gets an answer (a 4xx that says why, or a JSON 500); a request must arrive
whole within `Limits.client_timeout_s`, and only so many connections are open at once, a
waiting one closed to make room for a new one (see connections.py). With an API key, only
the page (`/`), its files and /health answer without it.
"""
import contextlib
import json
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from edgespec.errors import EdgespecError
from edgespec.settings import Settings

from . import openai_api as api
from .connections import (RETRY_AFTER_S, HeadTooLarge, Limits, Refused, RequestReader, Server,
                          check_api_key, client_gone, linger, read_body, require_key)
from .metrics import CONTENT_TYPE as METRICS_TYPE
from .metrics import Metrics
from .page import HEADERS as PAGE_HEADERS
from .page import load_page

CHECK_S = 0.25  # how often a waiting handler checks that its client is still there
OPEN_PATHS = {"/health"}  # with the page's files: answered without the API key


@dataclass
class Job:
    prompt_ids: list
    settings: Settings
    owner: str  # whose cached prompts and remembered replies it may use
    events: queue.Queue = field(default_factory=queue.Queue)  # text pieces, then a final dict
    cancelled: threading.Event = field(default_factory=threading.Event)


class Worker(threading.Thread):
    """Owns the model and its batch; decodes up to `parallel` jobs together, taking queued
    ones in arrival order as sequences free up. Every job gets a final event: {"finish",
    "generated", "result": the Generation or None} or {"error"}."""

    def __init__(self, model, queue_size, parallel=1, metrics: Metrics = None):
        super().__init__(daemon=True, name="edgespec-worker")
        self.model, self.jobs = model, queue.Queue(maxsize=queue_size)
        self.batch = model.batch(parallel)
        self.metrics = metrics or Metrics()
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0}
        self.running = {}  # Request -> its Job

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def submit(self, job: Job):
        self.jobs.put_nowait(job)  # queue.Full: the caller answers 503

    def run(self):
        while True:
            self._admit()
            batch = self.batch
            before = batch.committed, batch.rounds, batch.rows
            try:
                events = batch.step()
            except Exception as e:  # a runtime failure fails the replies of that round
                for reply in batch.clear():
                    self._fail(self.running.pop(reply), e)
                continue
            self.metrics.round_done(batch.committed - before[0], batch.rounds - before[1],
                                    batch.rows - before[2])
            for reply, piece in events:
                self.running[reply].events.put(piece.text)
            for reply in [m for m in self.running if m.result is not None]:
                self._end(self.running.pop(reply), reply.result)

    def _admit(self):
        """Queued jobs into the batch while it has room (waiting for one when nothing
        runs); cancelled jobs out of it."""
        while len(self.running) < self.batch.parallel:
            try:
                job = self.jobs.get(block=not self.running)
            except queue.Empty:
                break
            if job.cancelled.is_set():  # its client left while it waited
                self._end(job, None)
                continue
            try:
                self.running[self.batch.add(job.prompt_ids, job.settings, job.owner)] = job
            except Exception as e:  # a job the model refuses fails alone
                self._fail(job, e)
        for reply, job in self.running.items():
            if job.cancelled.is_set():
                self.batch.cancel(reply)

    def _fail(self, job, error):
        self.counts["failed"] += 1
        self.metrics.generation("failed", len(job.prompt_ids))
        message = str(error)
        if not isinstance(error, EdgespecError):  # unforeseen: the operator needs the traceback
            traceback.print_exc()
            message = f"{type(error).__name__}: {error}"
        job.events.put({"error": message})

    def _end(self, job, result):
        """A job's final event: its Generation (None: cancelled before it began)."""
        finish = "cancelled" if result is None else result.finish_reason
        generated = 0 if result is None else result.n_generated
        self.counts["cancelled" if finish == "cancelled" else "completed"] += 1
        self.metrics.generation(finish, len(job.prompt_ids), result, generated)
        job.events.put({"finish": finish, "generated": generated, "result": result})


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "edgespec"
    worker: Worker = None
    metrics: Metrics = None
    page: dict = {}  # URL path -> (content type, bytes)
    model_name = "edgespec"
    limits = Limits()
    allow_ignore_eos = False
    api_keys = ()  # any: the API needs `Authorization: Bearer KEY` with one of them
    max_tokens = None  # the most tokens a request may ask for (None: the context's room)
    timeout = limits.client_timeout_s  # socketserver sets it on the connection
    streaming = False  # the response has begun: an error can no longer be a JSON answer

    def log_message(self, fmt, *args):  # one quiet line per request, to stderr
        sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    def version_string(self):
        return self.server_version  # not the Python version behind it

    def setup(self):
        super().setup()
        self.rfile.close()  # the socket is read through the deadline-keeping reader instead
        self.rfile = RequestReader(self.connection, self.limits.max_head_bytes,
                                   lambda: self.metrics.connection_closed("timeout"))

    def handle_one_request(self):
        """One request, which must arrive whole within the client timeout; until it has, the
        server may close this connection to make room for another."""
        self.server.waiting(self.connection)
        self.rfile.begin(self.limits.client_timeout_s)
        self.command, self.request_version = "", self.default_request_version
        try:
            self.raw_requestline = self.rfile.readline()
            if not self.raw_requestline:
                self.close_connection = True
                return
            if not self.parse_request():  # it answered the error
                return
            if self.command != "POST":  # a POST is whole once its body is read
                self.server.answering(self.connection)
            getattr(self, f"do_{self.command}", self._method_not_allowed)()
            self.wfile.flush()
        except HeadTooLarge as e:
            self.send_error(431, str(e))
        except TimeoutError:  # a read (the request's deadline) or a write timed out
            self.close_connection = True
            if self.rfile.timed_out and self.rfile.received:  # not a connection left idle
                with contextlib.suppress(OSError):
                    self.send_error(408, "the request did not arrive whole within "
                                    f"{self.limits.client_timeout_s} s (the server's "
                                    "--client-timeout)")

    def parse_request(self) -> bool:
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        if len(self.requestline.split()) == 2:  # HTTP/0.9's bare "GET /" has no headers
            self.send_error(400, "HTTP/0.9 is not served here; send HTTP/1.0 or HTTP/1.1")
            return False
        return super().parse_request()

    def send_response(self, code, message=None):
        self.metrics.response(code)  # every answer passes here, errors of http.server too
        super().send_response(code, message)

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a request line or header it cannot parse) as JSON."""
        # it takes an unparsable request line for HTTP/0.9 and would answer without a
        # status line; nobody speaks 0.9 now, so the answer is a full HTTP/1.1 one
        self.request_version = "HTTP/1.1"
        self.close_connection = True
        self._json(code, api.error_body(message or self.responses.get(code, ("error",))[0]),
                   {"Connection": "close"})
        linger(self.connection)

    def _route(self) -> str:
        return urlsplit(self.path).path.rstrip("/") or "/"

    def _authorize(self, body_unread: bool):
        """Refuse a request without a valid key; note whose it is (`owner`): its key's, or
        its client address's on a server without keys."""
        self.owner = f"client {self.client_address[0]}"
        if self.api_keys:
            self.owner = f"key {require_key(self.headers, self.api_keys, body_unread)}"

    # -- routing ---------------------------------------------------------------------------

    def do_GET(self):
        route = self._route()
        if route in self.page:
            kind, data = self.page[route]
            self._send(200, kind, data, PAGE_HEADERS)
            return
        if route == "/health":
            worker = self.worker
            self._json(200, {"busy": worker.busy, "queued": worker.jobs.qsize(),
                             "running": len(worker.running), "parallel": worker.batch.parallel,
                             **worker.counts})
            return
        try:
            self._authorize(body_unread=False)
        except Refused as e:
            self._refuse(e)
            return
        if route == "/v1/models":
            self._json(200, {"object": "list", "data": [
                {"id": self.model_name, "object": "model", "created": 0, "owned_by": "edgespec",
                 "sampling": api.sampling_defaults(self.worker.model)}]})
        elif route == "/metrics":
            worker = self.worker
            text = self.metrics.render(worker.jobs.qsize(), worker.jobs.maxsize,
                                       len(worker.running), worker.batch.parallel,
                                       self.server.open_connections())
            self._send(200, METRICS_TYPE, text.encode())
        else:
            self._json(404, api.error_body(f"no route GET {self.path}", "not_found"))

    def _method_not_allowed(self):
        """Other methods: 405 (http.server would answer 501, as for a method it never heard
        of), the connection closed since a body may follow."""
        self.close_connection = True
        self._json(405, api.error_body(f"{self.command} is not served here; the API takes "
                                       "GET, HEAD and POST", "method_not_allowed"),
                   {"Allow": "GET, HEAD, POST", "Connection": "close"})
        linger(self.connection)

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _method_not_allowed

    def do_HEAD(self):
        self.do_GET()  # _send leaves the body out

    def do_POST(self):
        self.streaming = False
        started = time.monotonic()
        try:
            self._authorize(body_unread=True)
            self._route_post(started)
        except Refused as e:
            self._refuse(e)
        except api.BadRequest as e:
            self._json(400, api.error_body(str(e), param=e.param))
        except (ConnectionError, TimeoutError):  # the client left or stalled mid-answer
            self.close_connection = True
        except Exception as e:  # a bug: answer it, log it, keep serving
            self.log_error("%s", traceback.format_exc())
            if self.streaming:
                self.close_connection = True
            else:
                self._json(500, api.error_body(f"internal error: {type(e).__name__}: {e}",
                                               "server_error"))

    def _route_post(self, started):
        routes = {"/v1/chat/completions": self._chat, "/v1/completions": self._completion}
        # read even for a 404, so that the next request on the connection starts in step
        raw = read_body(self.headers, self.rfile, self.limits)
        self.server.answering(self.connection)
        handler = routes.get(self._route())
        if handler is None:
            self._json(404, api.error_body(f"no route POST {self.path}", "not_found"))
            return
        handler(api.parse_body(raw), started)

    # -- the two generation endpoints -----------------------------------------------------

    def _chat(self, body, started):
        messages = api.chat_messages(body)
        try:
            ids = self.worker.model.codec.encode_chat(messages)
        except EdgespecError as e:  # the chat template refused the conversation
            raise api.BadRequest(str(e), "messages") from e
        self._generate(body, ids, True, started)

    def _completion(self, body, started):
        self._generate(body, self.worker.model.codec.encode(api.completion_prompt(body)),
                       False, started)

    def _generate(self, body, ids, chat, started):
        settings = api.generation_settings(body, self.worker.model, self.allow_ignore_eos,
                                           self.max_tokens)
        stream, include_usage = api.stream_settings(body)
        limit = self.worker.model.engine.max_context
        if len(ids) >= limit:
            raise api.BadRequest(f"the prompt has {len(ids)} tokens; the context is {limit}",
                                 "messages" if chat else "prompt")
        # prompt and reply together fit the context, as OpenAI counts it
        job = Job(ids, settings.with_options(
            max_new_tokens=min(settings.max_new_tokens, limit - len(ids))), self.owner)
        try:
            self.worker.submit(job)
        except queue.Full:
            self._json(503, api.error_body("the server is busy; retry later", "server_busy"),
                       {"Retry-After": str(RETRY_AFTER_S)})
            return
        rid = api.new_id("chatcmpl" if chat else "cmpl")
        self.first_text_s = None  # set by _events
        try:
            if stream:
                self._stream(job, rid, chat, include_usage, started)
            else:
                self._complete(job, rid, chat, started)
            self.metrics.request_timed(time.monotonic() - started, self.first_text_s)
        finally:
            job.cancelled.set()  # a handler that stops early (client gone, error) stops its job

    def _events(self, job, started):
        """Text and the final event; cancels the job when the client has gone (checked
        every CHECK_S, streaming or not). Notes when the first text came (first_text_s,
        seconds after `started`)."""
        checked = time.monotonic()
        while True:
            try:
                event = job.events.get(timeout=CHECK_S)
            except queue.Empty:
                event = None
            if time.monotonic() - checked >= CHECK_S:
                checked = time.monotonic()
                if client_gone(self.connection):
                    job.cancelled.set()
            if event is None:
                continue
            if isinstance(event, dict):
                yield "", event
                return
            if self.first_text_s is None:
                self.first_text_s = time.monotonic() - started
            yield event, None

    def _complete(self, job, rid, chat, started):
        parts, final = [], None
        for text, final in self._events(job, started):
            parts.append(text)
        if "error" in final:
            self._json(500, api.error_body(final["error"], "server_error"))
            return
        finish = api.finish_reason(final["finish"])
        use = api.usage(len(job.prompt_ids), final["generated"], final["result"])
        respond = api.chat_response if chat else api.completion_response
        self._json(200, respond(rid, self.model_name, "".join(parts), finish, use))

    def _stream(self, job, rid, chat, include_usage, started):
        self.streaming = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        chunk = api.chat_chunk if chat else api.completion_chunk
        if chat:
            self._sse(chunk(rid, self.model_name, {"role": "assistant", "content": ""}))
        for text, final in self._events(job, started):
            if text:
                self._sse(chunk(rid, self.model_name, {"content": text} if chat else text))
            if final is None:
                continue
            if "error" in final:
                self._sse(api.error_body(final["error"], "server_error"))
                continue
            finish = api.finish_reason(final["finish"])
            self._sse(chunk(rid, self.model_name, {} if chat else "", finish))
            if include_usage:
                self._sse(chunk(rid, self.model_name, use=api.usage(
                    len(job.prompt_ids), final["generated"], final["result"])))
        self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    # -- writing ---------------------------------------------------------------------------

    def _sse(self, payload):
        self._write_chunk(f"data: {json.dumps(payload)}\n\n".encode())

    def _write_chunk(self, data: bytes):
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _json(self, status, payload, headers=None):
        self._send(status, "application/json", json.dumps(payload).encode(), headers)

    def _send(self, status, kind, data: bytes, headers=None):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":  # a HEAD answer has the headers alone
            self.wfile.write(data)

    def _refuse(self, refusal: Refused):
        """Answer, then close the connection (lingering over a body still on its way)."""
        self._json(refusal.status, api.error_body(str(refusal)),
                   {**refusal.headers, "Connection": "close"})
        if refusal.body_unread:
            linger(self.connection)


def make_server(model, host="127.0.0.1", port=8000, queue_size=32, limits=Limits(),
                allow_ignore_eos=False, api_keys=(), max_tokens=None, parallel=1) -> Server:
    """The server and its worker, listening; call serve_forever() on it.
    api_keys: the API (all but the page and /health) needs one of them as a bearer token,
    and each key's conversations are kept apart. max_tokens: the most tokens a request may
    ask for (more is a 400). parallel: replies decoded at once."""
    if max_tokens is not None and max_tokens < 1:
        raise EdgespecError(f"invalid --max-tokens {max_tokens}: it must be >= 1")
    metrics = Metrics()
    worker = Worker(model, queue_size, parallel, metrics)
    handler = type("BoundHandler", (Handler,), {
        "worker": worker, "metrics": metrics, "page": load_page(),
        "model_name": model.artifact.path.name, "limits": limits,
        "timeout": limits.client_timeout_s, "allow_ignore_eos": allow_ignore_eos,
        "api_keys": tuple(check_api_key(key) for key in api_keys),
        "max_tokens": max_tokens})
    try:
        httpd = Server((host, port), handler, limits, on_close=metrics.connection_closed)
    except OSError as e:
        raise EdgespecError(f"cannot listen on {host}:{port} ({e.strerror}); "
                            "choose another --port") from e
    worker.start()
    return httpd


def serve(model, host="127.0.0.1", port=8000, queue_size=32, ready=None, **options):
    """Serve until interrupted. `ready(address)` is called once the socket listens.
    options: those of make_server (limits, allow_ignore_eos, api_keys, max_tokens,
    parallel)."""
    httpd = make_server(model, host, port, queue_size, **options)
    (ready or (lambda address: None))(httpd.server_address)
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()
