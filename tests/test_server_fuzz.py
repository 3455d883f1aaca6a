"""Hundreds of bad requests, made from a fixed seed: each is answered with a 4xx that carries
a JSON error (never a 5xx, never a dropped connection), odd but valid text is answered
normally, and afterwards the server gives a normal request the same answer as before."""
import json
import random
import socket

import pytest
from helpers import chat_body, exchange, health, request_bytes, server_log, start_server, stop_server

SEED = 14
MAX_BODY_BYTES = 1 << 16
BASE = {"model": "art", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "hello"}]}

# values no field accepts, by field (each alone makes the request a 400)
INVALID = {
    "messages": [5, "hi", {}, [], [5], [None], [{"role": "robot", "content": "x"}],
                 [{"role": "user"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": {"text": "x"}}], [{"content": "x"}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": ["x"]}]}],
                 [{"role": ["user"], "content": "x"}], [[{"role": "user", "content": "x"}]]],
    "max_tokens": ["10", -1, 0, 1.5, True, [], {}, "", -(10**30)],
    "max_completion_tokens": [0, "x", -3, 2.5, False],
    "temperature": ["hot", -0.1, 2.5, [], {}, True, 1e308 * 10, "NaN"],
    "top_p": [-1, 1.5, 0, "x", [], True],
    "top_k": [-1, 1.5, "x", {}, True],
    "min_p": [-0.5, 2, "x", []],
    "repetition_penalty": [0, -1, "x", [1]],
    "seed": [-1, 2**63, 10**400, 1.5, "x", [], True],
    "stop": [5, [5], ["a"] * 5, [""], {"a": 1}, [None], True],
    "stream": ["yes", 1, [], {}, "true"],
    "stream_options": ["yes", 5, [], {"include_usage": "yes"}, {"include_usage": 1}],
    "n": [2, 0, "x", -1, 1.5],
    "presence_penalty": [2.5, "x", []],
    "frequency_penalty": [-2.5, {}],
    "mode": ["turbo", 5, [], {}, "", "PLAIN"],
    "ignore_eos": [True, "x", 1],  # refused: the server runs without --allow-ignore-eos
}
# text that is odd but valid: the server must answer it like any other
ODD_TEXT = ["\u0000", "a\u0000b", "\u202eRTL override\u202c", "\u05e9\u05dc\u05d5\u05dd",
            "\U0001f469\u200d\U0001f469\u200d\U0001f467", "e\u0301\u0301\u0301", "\ufeffBOM",
            "\u200b\u200c\u200d", "\U0010ffff", "\t\r\n\x0b\x0c", "\\u0000 as text",
            "\u65e5\u672c\u8a9e", "</script><script>alert(1)</script>", "\x7f\x1b[31m",
            "a" * 300, "\ud83d\ude00 " * 40, " ", "%s%n{0}"]


def junk(rng, depth=0):
    """A random JSON value, nested a little."""
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, -1, 2**70, 1.5, -1e300, 3])
    if kind == 3:
        return "".join(rng.choice("ab\u00e9\u4e2d\U0001f600\u0000\"\\") for _ in range(rng.randrange(8)))
    if kind == 4:
        return rng.choice(["", "x" * 1000, "user", "text"])
    if kind == 5:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": junk(rng, depth + 1) for i in range(rng.randrange(4))}


def wrong_fields(rng) -> bytes:
    """A valid body with 1-3 fields made invalid, and maybe some unknown fields."""
    body = json.loads(json.dumps(BASE))
    for name in rng.sample(sorted(INVALID), rng.randint(1, 3)):
        body[name] = rng.choice(INVALID[name])
    for i in range(rng.randrange(3)):
        body[f"unknown_{i}"] = junk(rng)
    return json.dumps(body).encode()


def malformed(rng) -> bytes:
    """Bytes that are not a JSON object, or not JSON, or not UTF-8."""
    valid = json.dumps({**BASE, "extra": junk(rng)}).encode()
    kind = rng.randrange(9)
    if kind == 0:
        return valid[:rng.randrange(1, len(valid) - 1)]  # cut short
    if kind == 1:
        return valid + rng.choice([b"}", b",", b" x", b"\x00", b"{}"])  # trailing junk
    if kind == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    if kind == 3:
        return valid.replace(b"hello", b"hel\xff\xfelo")  # not UTF-8
    if kind == 4:
        return json.dumps(junk(rng)).encode() if rng.random() < 0.5 else b"[]"
    if kind == 5:
        depth = rng.randrange(1100, 5000)
        return b"[" * depth + b"]" * depth
    if kind == 6:  # a lone surrogate, spelled as a JSON escape
        return chat_body(rng.choice(["\\ud800", "a\\udfffb", "\\udc00\\ud800"])).replace(
            b"\\\\u", b"\\u")
    if kind == 7:
        return valid.replace(b'"messages"', b"messages")  # an unquoted key
    return rng.choice([b"", b"null", b"0", b'"x"', b"NaN", b"{'a': 1}", b"\xef\xbb\xbf{}"])


def bad_framing(rng) -> bytes:
    """Requests the server must refuse before reading a body (or as a whole)."""
    body = chat_body()
    return rng.choice([
        request_bytes(b"x" * (MAX_BODY_BYTES + 1)),
        request_bytes(chat_body("x" * MAX_BODY_BYTES)),
        request_bytes(b"", headers={"Content-Length": str(rng.randrange(MAX_BODY_BYTES + 1,
                                                                        10**15))}),
        request_bytes(body, headers={"Content-Length": rng.choice(["-1", "1e3", "0x10", " "])}),
        request_bytes(body, headers={"Transfer-Encoding": "chunked"}),
        request_bytes(body, headers={}),
        request_bytes(body, path=rng.choice(["/v1/chat", "/v2/chat/completions", "/%00",
                                             "/v1/chat/completions/../x"])),
        request_bytes(body, method=rng.choice(["PUT", "DELETE", "PATCH"])),
        b"GARBAGE\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nbad header line\r\nContent-Length: %d\r\n\r\n%s"
        % (len(body), body),
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        request_bytes(chat_body("hello world " * 400)),  # longer than the context
    ])


def cases():
    """(name, raw request, expected): expected "4xx" or 200 (odd but valid)."""
    rng = random.Random(SEED)
    out = []
    for i in range(150):
        out.append((f"wrong fields {i}", request_bytes(wrong_fields(rng)), "4xx"))
    for i in range(100):
        out.append((f"malformed {i}", request_bytes(malformed(rng)), "4xx"))
    for i in range(60):
        out.append((f"framing {i}", bad_framing(rng), "4xx"))
    for i, text in enumerate(ODD_TEXT):
        out.append((f"odd text {i}", request_bytes(chat_body(text, max_tokens=2)), 200))
    for i in range(20):  # unknown fields alone are ignored, as other OpenAI servers do
        extra = {f"x_{j}": junk(rng) for j in range(rng.randint(1, 4))}
        out.append((f"unknown fields {i}", request_bytes(chat_body("hi", **extra)), 200))
    rng.shuffle(out)
    return out


@pytest.fixture(scope="module")
def server(tiny_int4):
    process, port = start_server(tiny_int4, "--max-body-bytes", str(MAX_BODY_BYTES),
                                 "--client-timeout", "5")
    yield process, port
    stop_server(process)


def normal_request(port):
    status, _, answer = exchange(port, request_bytes(chat_body("the quick brown fox",
                                                               max_tokens=12)))
    assert status == 200, answer
    answer = json.loads(answer)
    return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]


def test_hundreds_of_bad_requests_each_get_a_4xx_and_the_server_answers_as_before(server):
    process, port = server
    before = normal_request(port)
    all_cases = cases()
    assert len(all_cases) >= 300
    wrong = []
    for name, raw, expected in all_cases:
        try:
            status, head, body = exchange(port, raw)
        except (ConnectionError, socket.timeout) as e:
            wrong.append(f"{name}: no answer ({e!r}) to {raw[:120]!r}")
            continue
        answer = json.loads(body)
        if expected == 200:
            ok = status == 200 and isinstance(answer["choices"][0]["message"]["content"], str)
        else:
            ok = 400 <= status < 500 and isinstance(answer["error"]["message"], str)
        if not ok:
            wrong.append(f"{name}: {status} {body[:200]!r} to {raw[:120]!r}")
    assert not wrong, f"{len(wrong)} wrong answers:\n" + "\n".join(wrong[:20])
    assert normal_request(port) == before
    state = health(port)
    assert state["failed"] == 0 and not state["busy"] and state["queued"] == 0
    assert "Traceback" not in server_log(process)  # every request was foreseen
