"""Test helpers: a tiny random Llama-family checkpoint made on the fly, the CLI runner, and
a server in a subprocess spoken to over raw HTTP."""
import hashlib
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import (AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig,
                          PreTrainedTokenizerFast, Qwen2Config)

from edgespec.export.source import HF_SAMPLING

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts and verifies",
        "hello world, how are you today?", "numbers 0 1 2 3 4 5 6 7 8 9 and symbols !?.,"] * 20


def make_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>",
                                  "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = TEMPLATE
    return fast


GREEDY = {"do_sample": False}
GEMMA3_WINDOW = 8
GEMMA3_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


def make_checkpoint(path: Path, arch: str = "llama", tie: bool = True, layers: int = 4,
                    seed: int = 0, max_positions: int = 512, rope: dict = None,
                    intermediate_size: int = 128, generation: dict = GREEDY,
                    **config_overrides) -> Path:
    """A random checkpoint. generation: what its generation_config.json says of sampling
    (greedy by default, so the tests' replies are comparable; None: nothing)."""
    torch.manual_seed(seed)
    tokenizer = make_tokenizer(384)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=intermediate_size,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=tie,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                  rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    if arch == "gemma3":  # local layers with a small window, so tests cross it
        gemma = dict(rope_parameters=GEMMA3_ROPE, head_dim=16, sliding_window=GEMMA3_WINDOW,
                     query_pre_attn_scalar=24,
                     layer_types=["sliding_attention", "full_attention"] * (layers // 2))
        config = Gemma3TextConfig(**{**common, **gemma, **config_overrides})
    else:
        kind = {"qwen2": Qwen2Config, "mistral": MistralConfig}.get(arch, LlamaConfig)
        config = kind(**common, **config_overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random init is too tame to tell implementations apart: widen it
        for p in model.parameters():
            p.mul_(8.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    config_file = path / "generation_config.json"
    saved = json.loads(config_file.read_text()) if config_file.exists() else {}
    saved = {k: v for k, v in saved.items() if k not in ("do_sample", *HF_SAMPLING)}
    config_file.write_text(json.dumps({**saved, **(generation or {})}))
    return path


def quiet(*args, **kwargs):
    """A log function that prints nothing."""


def run_cli(*args, timeout=600):
    """Run `python -m edgespec ARGS`; the completed process, with text output."""
    return subprocess.run([sys.executable, "-m", "edgespec", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def one_error_line(stderr: str) -> str:
    """The single `error: ...` line a failed command printed (fails if there is not exactly one)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


def rewrite_artifact_file(artifact: Path, name: str, data: bytes):
    """Replace one file of an artifact and update its size and sha256 in the manifest, so
    only what the test changes is wrong."""
    (artifact / name).write_bytes(data)
    path = artifact / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    path.write_text(json.dumps(manifest))


# -- `edgespec serve` in a subprocess, and raw HTTP on loopback -------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(artifact, *args):
    """`edgespec serve ARTIFACT ARGS` on a free port; (process, port) once it answers."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would block the server
    process = subprocess.Popen([sys.executable, "-m", "edgespec", "serve", str(artifact),
                                "--port", str(port), *args], stderr=log, text=True)
    process.log = log
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            health(port)
            return process, port
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(server_log(process))


def server_log(process) -> str:
    """What the server has written to stderr so far."""
    process.log.seek(0)
    return process.log.read()


def stop_server(process):
    process.terminate()
    process.wait(10)
    process.log.close()


def health(port) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def wait_idle(port, timeout=30) -> dict:
    """/health once nothing runs or waits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = health(port)
        if not state["busy"] and state["queued"] == 0:
            return state
        time.sleep(0.05)
    raise AssertionError(f"the server stayed busy: {state}")


def wait_for(port, timeout=10, **state) -> dict:
    """/health once it shows `state` (running=2, queued=1, ...)."""
    deadline = time.monotonic() + timeout
    while True:
        now = health(port)
        if all(now[name] == value for name, value in state.items()):
            return now
        assert time.monotonic() < deadline, f"the server never showed {state}: {now}"
        time.sleep(0.01)


def wait_busy(port, timeout=30):
    deadline = time.monotonic() + timeout
    while not health(port)["busy"]:
        assert time.monotonic() < deadline, "the server never started the request"
        time.sleep(0.01)


def request_bytes(body: bytes, path="/v1/chat/completions", method="POST", headers=None) -> bytes:
    """A raw HTTP/1.1 request; Content-Length from the body unless `headers` sets framing."""
    headers = {"Host": "x", "Content-Type": "application/json",
               **({"Content-Length": str(len(body))} if headers is None else headers)}
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode() + body


def chat_body(content="hi", **fields) -> bytes:
    return json.dumps({"model": "art", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": content}], **fields}).encode()


def read_response(reader):
    """One HTTP response from a socket's binary file: (status, headers, body). Bodies with a
    Content-Length are read whole; without one, up to the end of the connection."""
    status_line = reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection without an answer")
    status = int(status_line.split()[1])
    headers = {}
    for line in iter(reader.readline, b"\r\n"):
        if not line:
            break
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    length = headers.get("content-length")
    body = reader.read(int(length)) if length is not None else reader.read()
    return status, headers, body


def exchange(port, raw: bytes, timeout=10):
    """Send raw bytes on a new connection and read one response (status, headers, body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        return read_response(sock.makefile("rb"))


def open_stream(port, max_tokens=4000):
    """Start a long streaming chat (ignore_eos) on a raw socket; returns it after the first
    bytes."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    body = json.dumps({"model": "art", "stream": True, "max_tokens": max_tokens,
                       "ignore_eos": True, "messages": [{"role": "user", "content": "go"}]})
    sock.sendall(request_bytes(body.encode()))
    return sock, sock.recv(4096)


def server_threads(process) -> int:
    """Threads the server process runs now (Linux)."""
    return len(os.listdir(f"/proc/{process.pid}/task"))


def settled_threads(process) -> int:
    """The server's thread count at rest: the least seen over half a second (a handler
    thread may take a moment to end after its client closes)."""
    counts = []
    for _ in range(20):
        counts.append(server_threads(process))
        time.sleep(0.025)
    return min(counts)


def wait_threads(process, at_most, timeout=15):
    deadline = time.monotonic() + timeout
    while server_threads(process) > at_most:
        assert time.monotonic() < deadline, \
            f"the server still runs {server_threads(process)} threads, {at_most} when idle"
        time.sleep(0.05)


def pump(root, until, timeout=30):
    """Run the Tk loop until `until()` is true."""
    deadline = time.time() + timeout
    while not until() and time.time() < deadline:
        root.update()
        time.sleep(0.002)
    root.update()
    assert until(), f"not done within {timeout} s"
