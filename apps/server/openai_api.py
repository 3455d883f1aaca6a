"""The OpenAI API's shapes: requests to generation options, results to response bodies."""
import time
import uuid

from edgespec.errors import EdgespecError
from edgespec.sampling import SamplingParams


class BadRequest(Exception):
    """A request the server refuses with 400; `param` names the field at fault."""

    def __init__(self, message, param=None):
        super().__init__(message)
        self.param = param


def error_body(message, kind="invalid_request_error", param=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def _number(body, name, default, integer=False):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (integer and not float(value).is_integer()):
        raise BadRequest(f"{name} must be {'an integer' if integer else 'a number'}, "
                         f"not {value!r}", name)
    return int(value) if integer else float(value)


def generation_options(body: dict) -> dict:
    """Sampling and length options from an OpenAI request (validated)."""
    if _number(body, "n", 1, integer=True) != 1:
        raise BadRequest("only n = 1 is supported", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0):
            raise BadRequest(f"{name} is not supported; use repetition_penalty", name)
    max_tokens = _number(body, "max_completion_tokens", None, integer=True) or \
        _number(body, "max_tokens", 256, integer=True)
    if max_tokens < 1:
        raise BadRequest(f"max_tokens must be >= 1, not {max_tokens}", "max_tokens")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest("stop must be a string or a list of up to 4 non-empty strings", "stop")
    sampling = {"temperature": _number(body, "temperature", 1.0),
                "top_p": _number(body, "top_p", 1.0),
                "top_k": _number(body, "top_k", 0, integer=True),
                "min_p": _number(body, "min_p", 0.0),
                "repetition_penalty": _number(body, "repetition_penalty", 1.0),
                "seed": _number(body, "seed", None, integer=True)}
    if sampling["temperature"] > 2:
        raise BadRequest("temperature must be in [0, 2]", "temperature")
    try:
        SamplingParams(**sampling)
    except EdgespecError as e:
        raise BadRequest(str(e)) from e
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be true or false", "ignore_eos")
    return {"max_new_tokens": max_tokens, "stop": stop, "sampling": sampling,
            "ignore_eos": ignore_eos}


def chat_messages(body: dict) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                             "developer"):
            raise BadRequest("each message needs a role: system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str):
            raise BadRequest("message content must be a string", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": content})
    return out


def completion_prompt(body: dict) -> str:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt must be a non-empty string", "prompt")
    return prompt


class StopScanner:
    """Cuts streamed text at the first stop string, holding back what may begin one."""

    def __init__(self, stops):
        self.stops, self.pending, self.stopped = stops, "", False

    def feed(self, text: str) -> str:
        """The text that is safe to send now."""
        self.pending += text
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                self.stopped = True
                out, self.pending = self.pending[:at], ""
                return out
        hold = max((n for s in self.stops for n in range(1, len(s))
                    if self.pending.endswith(s[:n])), default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def new_id(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens, completion_tokens) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


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


def finish_reason(generation_finish: str, stopped: bool) -> str:
    """OpenAI's finish_reason: "stop" at an end of turn or a stop string, else "length"."""
    return "stop" if stopped or generation_finish == "stop" else "length"
