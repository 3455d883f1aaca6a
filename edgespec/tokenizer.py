"""Text in and out without transformers: `tokenizers` for ids, jinja2 for the chat template."""
import contextlib
import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .errors import EdgespecError


def _raise(message):
    raise jinja2.TemplateError(message)


class TextCodec:
    """Encodes prompts (raw or through the chat template) and decodes ids, also incrementally."""

    def __init__(self, artifact_dir: Path, chat_template: str = None):
        path = artifact_dir / "tokenizer.json"
        with _named(path):  # the library's own errors do not say which file
            self.tokenizer = Tokenizer.from_file(str(path))
        path = artifact_dir / "tokenizer_config.json"
        with _named(path):
            config = json.loads(path.read_text()) if path.is_file() else {}
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        with _named("the chat template"):
            self.template = env.from_string(chat_template) if chat_template else None

    @classmethod
    def for_artifact(cls, artifact) -> "TextCodec":
        """The codec of an opened artifact: its tokenizer and chat template."""
        template = artifact.path / artifact.manifest["chat_template"]
        with _named(template):
            text = template.read_text()
        return cls(artifact.path, text)

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        if self.template is None:
            return "".join(m["content"] + "\n" for m in messages)
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except jinja2.TemplateError as e:  # raise_exception(), or a template that fails here
            raise EdgespecError(f"the chat template refused the messages: {e}") from e

    def encode_chat(self, messages) -> list:
        # the template writes the special tokens itself
        return self.encode(self.render_chat(messages), add_special_tokens=False)


@contextlib.contextmanager
def _named(what):
    """Turns any failure to read `what` into one line that names it."""
    try:
        yield
    except Exception as e:
        raise EdgespecError(f"{what} cannot be read ({type(e).__name__}: {e}); "
                            "export the model again") from e


def _token_text(token):
    return token.get("content") if isinstance(token, dict) else token


class StreamDecoder:
    """Turns a growing list of ids into text pieces, holding back incomplete characters."""

    def __init__(self, codec: TextCodec):
        self.codec, self.ids, self.prefix, self.read = codec, [], 0, 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.codec.decode(self.ids[self.prefix:self.read])
        after = self.codec.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before):]
        return ""
