"""One set of sampling defaults: the model's recommended settings (its checkpoint's
generation_config.json, recorded in the manifest) or the chat defaults, used alike by the
Python API, `generate`, `chat`, the server's API and page, and the desktop app."""
import json
import os
import urllib.request

import pytest
from helpers import make_checkpoint, pump, quiet, run_cli, start_server, stop_server

import edgespec
from edgespec import cli
from edgespec.chat import ChatSession
from edgespec.sampling import CHAT_DEFAULTS, SAMPLING_FIELDS, SamplingParams
from edgespec.export.pipeline import export_model

RECOMMENDED = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "repetition_penalty": 1.2}
MESSAGES = [{"role": "user", "content": "hello world"}]


def export(tmp_path_factory, name, generation):
    path = tmp_path_factory.mktemp(name)
    make_checkpoint(path / "ckpt", generation=generation)
    export_model(str(path / "ckpt"), path / "art", log=quiet)
    return path / "art"


@pytest.fixture(scope="module")
def recommending(tmp_path_factory):
    """An artifact whose checkpoint recommends sampling settings."""
    return export(tmp_path_factory, "recommending", RECOMMENDED)


def settings(generation) -> dict:
    """The sampling fields of a reply's settings (the seed apart)."""
    return {name: generation.sampling[name] for name in SAMPLING_FIELDS}


def test_a_checkpoints_recommended_settings_become_the_artifacts_defaults(recommending):
    model = edgespec.load(recommending)
    # transformers' own defaults fill what the config leaves out (top-k 50)
    assert model.artifact.manifest["sampling"] == {
        "temperature": 0.6, "top_k": 50, "top_p": 0.95, "min_p": 0.0, "repetition_penalty": 1.2}
    assert model.sampling == SamplingParams(temperature=0.6, top_k=50, top_p=0.95,
                                            repetition_penalty=1.2)


def test_without_recommended_settings_replies_sample_with_the_chat_defaults(tmp_path_factory):
    model = edgespec.load(export(tmp_path_factory, "silent", None))
    assert "sampling" not in model.artifact.manifest
    assert model.sampling == CHAT_DEFAULTS and not CHAT_DEFAULTS.greedy
    reply = model.generate("hello", max_new_tokens=4, seed=1)
    assert settings(reply) == {name: getattr(CHAT_DEFAULTS, name) for name in SAMPLING_FIELDS}


def test_temperature_zero_is_plain_greedy_unless_a_penalty_is_given(recommending):
    model = edgespec.load(recommending)
    greedy = model.generate_ids([5, 6, 7], max_new_tokens=4, temperature=0).sampling
    assert {name: greedy[name] for name in SAMPLING_FIELDS} == \
        {name: getattr(SamplingParams(), name) for name in SAMPLING_FIELDS}
    penalized = model.generate_ids([5, 6, 7], max_new_tokens=4, temperature=0,
                                   repetition_penalty=1.3).sampling
    assert penalized["temperature"] == 0 and penalized["repetition_penalty"] == 1.3


def test_every_entry_point_samples_with_the_models_defaults(recommending, display):
    model = edgespec.load(recommending)
    want = {name: getattr(model.sampling, name) for name in SAMPLING_FIELDS}
    stream = model.chat(MESSAGES, stream=True, max_new_tokens=12, seed=3)
    shown = "".join(stream)  # the text as streamed (an incomplete last character held back)
    library = stream.result
    assert settings(library) == want

    # generate: the reply and its settings as the library's, for the same seed
    out = run_cli("generate", recommending, "-p", "hello world", "--max-new-tokens", "12",
                  "--seed", "3", "--json")
    generated = json.loads(out.stdout)
    assert {k: generated["sampling"][k] for k in SAMPLING_FIELDS} == want
    assert generated["tokens"] == library.tokens

    # chat: the settings the command line gives a session
    args = cli.parser().parse_args(["chat", str(recommending), "--seed", "3"])
    with open(os.devnull, "w") as quiet_out:
        session = ChatSession(edgespec.load(recommending),
                              {**cli._options(args), "max_new_tokens": 12}, out=quiet_out)
        session.turn("hello world")
    assert settings(session.last) == want and session.last.tokens == library.tokens

    # the API: fields a request leaves out, and what GET /v1/models tells the page
    process, port = start_server(recommending)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        listed = json.load(urllib.request.urlopen(f"{base}/models"))["data"][0]["sampling"]
        request = urllib.request.Request(f"{base}/chat/completions", json.dumps(
            {"messages": MESSAGES, "max_tokens": 12, "seed": 3}).encode())
        answer = json.load(urllib.request.urlopen(request))
    finally:
        stop_server(process)
    assert listed == want
    assert answer["choices"][0]["message"]["content"] == shown

    # the desktop app
    import tkinter as tk
    from edgespec.apps.desktop.chat_window import ChatWindow
    root = tk.Tk()
    window = ChatWindow(root, edgespec.load(recommending), max_new_tokens=12, seed=3)
    window.send("hello world")
    pump(root, lambda: not window.busy)
    root.destroy()
    assert settings(window.last) == want and window.last.tokens == library.tokens
