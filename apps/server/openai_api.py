"""The OpenAI API's shapes: requests to generation options, results to response bodies."""
import json
import time
import uuid

from edgespec.errors import SettingError
from edgespec.options import CATALOGUE, SAMPLING
from edgespec.sampling import SAMPLING_FIELDS

# the generation options a request gives by their own names, each checked by its catalogue
# entry (the draft policy is the artifact's); besides them max_tokens (max_new_tokens) and
# stop, a string or a list that Settings checks
FIELDS = (*(option.name for option in SAMPLING), "mode", "ignore_eos")


class BadRequest(Exception):
    """A request the server refuses with 400; `param` names the field at fault."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


def error_body(message, kind="invalid_request_error", param=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def parse_body(raw: bytes) -> dict:
    """A request body: one JSON object."""
    try:
        body = json.loads(raw)
    except ValueError as e:  # not JSON, or not UTF-8
        raise BadRequest(f"the body is not JSON: {e}") from e
    except RecursionError:
        raise BadRequest("the body is nested too deeply to be a request") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _flag(body, name, param=None) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, not {_shown(value)}", param or name)
    return bool(value)


def _option(body, field, name=None):
    """A field that is a generation option (`name`, default: the field's own), checked by
    its catalogue entry; absent or null: None, not given."""
    option, value = CATALOGUE[name or field], body.get(field)
    if option.kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON has one kind of number: 2.0 is the integer 2
    try:
        return option.check(value, field) if value is not None else None
    except SettingError as e:
        raise BadRequest(str(e), field) from None


def _max_new_tokens(body, cap) -> int:
    # max_completion_tokens (the newer name) wins when given, even when it is invalid
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    value = _option(body, name, "max_new_tokens")
    if value is None:
        default = CATALOGUE["max_new_tokens"].default
        return min(default, cap) if cap else default
    if cap and value > cap:
        raise BadRequest(f"{name} {value} is above this server's limit of {cap} tokens a "
                         "reply (its --max-tokens)", name)
    return value


def generation_settings(body: dict, model, allow_ignore_eos: bool = False,
                        max_tokens: int = None):
    """The Settings of an OpenAI request (validated; a field it leaves out, or null, is the
    model's default). ignore_eos is refused unless the server allows it: it lets one request
    hold the worker for a whole context. max_tokens: the most tokens a reply may ask for
    (None: no limit but the context)."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise BadRequest("only n = 1 is supported", "n")
    _refuse_unsupported(body)
    options = {name: _option(body, name) for name in FIELDS}
    if (options["temperature"] or 0) > 2:
        raise BadRequest(f"temperature {options['temperature']} is above 2, the most this "
                         "server takes (OpenAI's range is [0, 2])", "temperature")
    if options["ignore_eos"] and not allow_ignore_eos:
        raise BadRequest("ignore_eos is off on this server (a reply could hold it for a whole "
                         "context); start it with --allow-ignore-eos", "ignore_eos")
    options.update(max_new_tokens=_max_new_tokens(body, max_tokens), stop=_stops(body))
    try:
        return model.settings(**options)
    except SettingError as e:
        raise BadRequest(str(e), e.name) from e


# fields that would change what a reply is, which this server does not do, and the value
# that asks for nothing: a request giving anything else is refused rather than half-served
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None,), "tools": (None, []),
               "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "logit_bias": (None, {}),
               "response_format": (None, {"type": "text"})}


def _refuse_unsupported(body):
    for name, nothing in UNSUPPORTED.items():
        if name in body and not any(body[name] == n and type(body[name]) is type(n)
                                    for n in nothing):
            raise BadRequest(f"{name} is not supported by this server; leave it out", name)


def _stops(body):
    """The stop strings as given, a string or a list (Settings checks how many and how
    long: an empty one is refused, as in the Python API)."""
    stop = body.get("stop")
    for text in [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []:
        if isinstance(text, str):
            _unicode(text, "stop")
    return stop


def sampling_defaults(model) -> dict:
    """What a request that leaves sampling fields out samples with (the chat page shows it)."""
    return {name: getattr(model.sampling, name) for name in SAMPLING_FIELDS}


def stream_settings(body: dict) -> tuple:
    """(stream, include_usage) of a request."""
    options = body.get("stream_options")
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise BadRequest(f"stream_options must be an object, not {_shown(options)}",
                         "stream_options")
    return _flag(body, "stream"), _flag(options, "include_usage", "stream_options")


def _unicode(text: str, param: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON escapes can spell a lone surrogate
        raise BadRequest(f"{param} is not valid Unicode text (a lone surrogate at character "
                         f"{e.start})", param) from None
    return text


def _content(content) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest("content parts must be {\"type\": \"text\", \"text\": a string} "
                                 f"(this server reads text only), not {_shown(part)}",
                                 "messages")
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise BadRequest("message content must be a string or a list of text parts",
                         "messages")
    return _unicode(content, "messages")


def chat_messages(body: dict) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                             "developer"):
            raise BadRequest("each message needs a role: system, user or assistant", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _content(m.get("content"))})
    return out


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string", "prompt")
    return _unicode(prompt, "prompt")


def new_id(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens, completion_tokens, result=None) -> dict:
    """OpenAI's usage, and under "edgespec" what decoding did when the Generation is known
    (a request cancelled before it began has none)."""
    use = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if result is not None:
        use["edgespec"] = speculation(result)
    return use


def speculation(result) -> dict:
    """One reply's decoding numbers (plain decoding drafts nothing: its counts are 0)."""
    stats = result.stats
    return {"mode": result.mode, "tokens_per_s": round(result.decode_tokens_per_s, 2),
            "prefill_s": round(result.prefill_s, 4), "decode_s": round(result.decode_s, 4),
            "cached_prompt_tokens": result.n_prompt - result.n_prefilled,
            "drafted": stats.drafted, "accepted": stats.accepted, "rounds": stats.rounds,
            "acceptance": round(stats.acceptance, 4),
            "accepted_per_round": round(stats.accepted_per_round, 4),
            "tokens_per_round": round(stats.tokens_per_round, 4),
            "drafters": stats.to_dict()["drafters"]}


def chat_response(rid, model, text, finish, use) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish, "logprobs": None}], "usage": use}


def chat_chunk(rid, model, delta=None, finish=None, use=None) -> dict:
    choices = [] if use else [{"index": 0, "delta": delta or {}, "finish_reason": finish,
                               "logprobs": None}]
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
             "model": model, "choices": choices}
    if use:
        chunk["usage"] = use
    return chunk


def completion_response(rid, model, text, finish, use) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
            "usage": use}


def completion_chunk(rid, model, text="", finish=None, use=None) -> dict:
    chunk = completion_response(rid, model, text, finish, use)
    if use:
        chunk["choices"] = []
    else:
        del chunk["usage"]
    return chunk


def finish_reason(generation_finish: str) -> str:
    """OpenAI's finish_reason: "stop" at an end of turn or a stop string, else "length"."""
    return "stop" if generation_finish == "stop" else "length"
