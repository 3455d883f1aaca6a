"""Text in and out without transformers: `tokenizers` for ids, jinja2 for the chat template."""
import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _raise(message):
    raise jinja2.TemplateError(message)


class TextCodec:
    """Encodes prompts (raw or through the chat template) and decodes ids, also incrementally."""

    def __init__(self, artifact_dir: Path, chat_template: str = None):
        self.tokenizer = Tokenizer.from_file(str(artifact_dir / "tokenizer.json"))
        config_path = artifact_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(chat_template) if chat_template else None

    @classmethod
    def for_artifact(cls, artifact) -> "TextCodec":
        """The codec of an opened artifact: its tokenizer and chat template (if any)."""
        template = artifact.path / artifact.manifest["chat_template"]
        return cls(artifact.path, template.read_text() if template.is_file() else None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages, add_generation_prompt: bool = True) -> str:
        if self.template is None:
            return "".join(m["content"] + "\n" for m in messages)
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                    **self.special)

    def encode_chat(self, messages) -> list:
        # the template writes the special tokens itself
        return self.encode(self.render_chat(messages), add_special_tokens=False)


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
