"""Text in and out without transformers: `tokenizers` for ids, jinja2 for the chat template.

In a chat, special tokens come only from the template's own markup. Text in a message that
spells one (a user typing "<|im_end|>") is encoded as the plain text it is, so no message can
open or close a turn: each message's special-token text is replaced by a placeholder before
the template renders, the rendering is cut at the special tokens left (the template's), and
the text between them is encoded, placeholders restored, by a tokenizer that reads
special-token text as text."""
import contextlib
import json
import re
from pathlib import Path
from typing import NamedTuple

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from .errors import EdgespecError, is_int

ESCAPE, END = "\ue000", "\ue001"  # private use: a placeholder is ESCAPE, an index, END
TEMPLATE_ITEMS = 1 << 20  # the longest string or list one template operation may make
TEMPLATE_INT_BITS = 1 << 16  # the largest integer one template operation may make


class TextCodec:
    """Encodes prompts (raw or through the chat template) and decodes ids, also incrementally."""

    def __init__(self, artifact_dir: Path, chat_template: str = None):
        path = artifact_dir / "tokenizer.json"
        with _named(path):  # the library's own errors do not say which file
            spec = path.read_text()
            self.tokenizer = Tokenizer.from_str(spec)
            # instances of their own, so that threads never toggle a shared flag
            self.text_tokenizer = _text_tokenizer(spec)
            # its own only where its pre-tokenizer differs (a large vocabulary's tokenizer
            # takes tens of megabytes)
            after = _after_special(spec)
            self.text_after_special = self.text_tokenizer if after == spec else \
                _text_tokenizer(after)
        config = _read_config(artifact_dir / "tokenizer_config.json")
        self.special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
        self.special_tokens = _special_tokens(self.tokenizer, self.special.values())
        texts = sorted(self.special_tokens, key=len, reverse=True)  # the longest match first
        self._special_re = re.compile("|".join(map(re.escape, texts)) or "(?!)")
        self._escaped = [ESCAPE, *texts]  # placeholder i stands for _escaped[i]
        self._escape_re = re.compile("|".join(map(re.escape, self._escaped)))
        self._index = {text: i for i, text in enumerate(self._escaped)}
        self._placeholder_re = re.compile(f"{ESCAPE}([0-9]+){END}")
        env = _ChatSandbox(trim_blocks=True, lstrip_blocks=True)
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
        """Raw text to ids; special-token text in it becomes special tokens (the caller
        writes the whole prompt)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def encode_chat(self, messages) -> list:
        """A conversation through the chat template to ids; the special tokens are only those
        the template writes (the messages' text stays text)."""
        text = self._render([{key: self._escape(value) if isinstance(value, str) else value
                              for key, value in m.items()} for m in messages])
        ids, start, before = [], 0, None
        for match in self._special_re.finditer(text):
            token = self.special_tokens[match.group()]
            ids += self._encode_text(text[start:match.start()], before, token)
            ids.append(token.id)
            start, before = match.end(), token
        return ids + self._encode_text(text[start:], before, None)

    def _encode_text(self, escaped: str, before, after) -> list:
        """The ids of the text between two special tokens (None: the rendering's start or
        end), as encoding the whole rendering would give them."""
        text = self._placeholder_re.sub(lambda m: self._escaped[int(m.group(1))], escaped)
        if before is not None and before.rstrip:
            text = text.lstrip()
        if after is not None and after.lstrip:
            text = text.rstrip()
        tokenizer = self.text_tokenizer if before is None else self.text_after_special
        return tokenizer.encode(text, add_special_tokens=False).ids

    def _escape(self, text: str) -> str:
        return self._escape_re.sub(lambda m: f"{ESCAPE}{self._index[m.group()]}{END}", text)

    def _render(self, messages, add_generation_prompt: bool = True) -> str:
        if self.template is None:
            return "".join(m["content"] + "\n" for m in messages)
        try:
            return self.template.render(messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except _Refusal as e:  # the template's raise_exception()
            raise EdgespecError(f"the chat template refused the messages: {e}") from e
        except Exception as e:  # a template that fails here, or builds too much
            raise EdgespecError(f"the chat template failed on these messages "
                                f"({type(e).__name__}: {e}); fix the artifact's chat template "
                                "or export the model again") from e


def check_utf8(text, what: str):
    """Refuse text read from the command line or a terminal that was not UTF-8: Python hands
    over such bytes as lone surrogates, which no tokenizer takes. None passes."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        byte = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else "a lone surrogate"
        raise EdgespecError(f"{what} is not valid UTF-8 ({byte} at character {e.start}); "
                            "use UTF-8 text") from None


class _Refusal(jinja2.TemplateError):
    """What a template's raise_exception() raises."""


def _raise(message):
    raise _Refusal(message)


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """jinja2's sandbox with the sizes of *, ** and + bounded: a template computing
    "a" * 10**10 fails at once instead of filling memory."""
    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, operator, left, right):
        if operator == "**" and is_int(left) and is_int(right) and abs(left) > 1 and right > 0:
            _check_bits(left.bit_length() * right, operator)
        elif operator == "*" and is_int(left) and is_int(right):
            _check_bits(left.bit_length() + right.bit_length(), operator)
        elif operator == "*":
            for items, times in ((left, right), (right, left)):
                if _is_sized(items) and is_int(times):
                    _check_items(len(items) * times, operator)
        elif _is_sized(left) and _is_sized(right):
            _check_items(len(left) + len(right), operator)
        return super().call_binop(context, operator, left, right)


def _is_sized(value) -> bool:
    return isinstance(value, (str, list, tuple))


def _check_items(n, operator):
    if n > TEMPLATE_ITEMS:
        raise jinja2.sandbox.SecurityError(
            f"'{operator}' would make a string or list of {n} items; a chat template may make "
            f"at most {TEMPLATE_ITEMS}")


def _check_bits(bits, operator):
    if bits > TEMPLATE_INT_BITS:
        raise jinja2.sandbox.SecurityError(
            f"'{operator}' would make an integer of about {bits} bits; a chat template may make "
            f"at most {TEMPLATE_INT_BITS}")


def _text_tokenizer(spec: str) -> Tokenizer:
    """A tokenizer that reads special-token text as text."""
    tokenizer = Tokenizer.from_str(spec)
    tokenizer.encode_special_tokens = True
    return tokenizer


def _after_special(spec: str) -> str:
    """The tokenizer spec for text that follows a special token, which is not at the start
    of the input: a Metaspace pre-tokenizer that adds its prefix space only there ("first")
    adds none. The spec itself where nothing changes."""
    parsed = json.loads(spec)
    return json.dumps(parsed) if _never_prepend(parsed.get("pre_tokenizer")) else spec


def _never_prepend(part) -> bool:
    """Turn "first" Metaspace prefixes in `part` to "never"; whether there was one."""
    changed = False
    if isinstance(part, dict):
        if part.get("type") == "Metaspace" and part.get("prepend_scheme") == "first":
            part["prepend_scheme"] = "never"
            changed = True
        for inner in part.get("pretokenizers", []):
            changed |= _never_prepend(inner)
    return changed


class _Special(NamedTuple):
    id: int
    lstrip: bool  # the token swallows the spaces before it
    rstrip: bool  # and after it


def _special_tokens(tokenizer, named) -> dict:
    """Text -> _Special of every special token: the added tokens marked special, and the
    bos and eos tokens tokenizer_config.json names."""
    return {token.content: _Special(token_id, token.lstrip, token.rstrip)
            for token_id, token in tokenizer.get_added_tokens_decoder().items()
            if token.special or token.content in named}


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    with _named(path):
        config = json.loads(path.read_text())
    if not isinstance(config, dict):
        shown = json.dumps(config)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise EdgespecError(f"{path} holds {shown}; it must be a JSON object (of "
                            "bos_token, eos_token, ...); export the model again")
    return config


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
