"""The OpenAI request bodies this server takes, checked field by field: a bad field becomes an `APIError` naming it
(HTTP 400 with an OpenAI-style body), never an exception inside the model loop.

Supported: /v1/completions (prompt: a string, a list of token ids, or a list of one string) and /v1/chat/completions
(messages with string or text-part content, through the tokenizer's chat template); max_tokens, temperature, top_p,
top_k (an extension), seed, stop, stream, stream_options.include_usage. Refused, because the server would otherwise
silently ignore them: n > 1, best_of > 1, logprobs, echo, suffix, penalties, logit_bias, tools, non-text formats, and
any field OpenAI does not define.

Numbers must be finite and in range (NaN, inf, seed outside torch's [-2^63, 2^64), integers too large for any C type
are a 400 naming the field); chat roles are system, user and assistant; a prompt far longer than the context is
refused from a prefix's token count (`_tokenize`). Error messages echo at most a short, encodable excerpt of a value.
"""

import math
from dataclasses import dataclass

from toolkit.engine.sampling import SamplingParams


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with HTTP `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": _printable(self.message, 2000), "type": self.type,
                          "param": None if self.param is None else _printable(self.param, 200), "code": self.code}}


def _printable(text: str, limit: int) -> str:
    """Encodable (a lone surrogate echoed back would fail the response's UTF-8 encoding) and bounded."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"}
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "suffix"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                   "function_call", "response_format", "parallel_tool_calls"}


def bad(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{param}: {what} is not supported by this server", param=param, code="unsupported_parameter")


def _number(body: dict, key: str, default, kind=float, minimum=None, maximum=None):
    """body[key] as a finite `kind` within [minimum, maximum]; a wrong type, NaN/inf or out-of-range value is a 400
    naming `key` (never an OverflowError or a NaN that passes every comparison)."""
    value = body.get(key)
    if value is None:
        return default
    shown = _short(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"{key} must be {'an integer' if kind is int else 'a number'}, got {shown}", key, "invalid_type")
    if isinstance(value, float) and not math.isfinite(value):
        raise bad(f"{key} must be a finite number, got {shown}", key)
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise bad(f"{key} must be an integer, got {shown}", key, "invalid_type")
        value = int(value)
    if minimum is not None and value < minimum:
        raise bad(f"{key} must be >= {minimum}, got {shown}", key)
    if maximum is not None and value > maximum:
        raise bad(f"{key} must be <= {maximum}, got {shown}", key)
    if kind is float and isinstance(value, int):
        if abs(value) > 2**53:  # (only reachable without a maximum) beyond exact floats; 10**400 would overflow
            raise bad(f"{key} is out of range, got {shown}", key)
        value = float(value)
    return value


def _short(value, limit: int = 60) -> str:
    """repr(value), cut to `limit` characters: error messages echo what was sent without echoing megabytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value) if isinstance(value, (str, int, float, bool)) or value is None else type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _refuse_unsupported(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise APIError(400, f"unrecognized request argument(s): {', '.join(unknown)[:200]}",
                       param=unknown[0], code="unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise unsupported("n", "more than one choice per request (n > 1)")
    if body.get("best_of") not in (None, 1):
        raise unsupported("best_of", "best_of > 1")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise unsupported("logprobs", "returning log-probabilities")
    if body.get("echo"):
        raise unsupported("echo", "echoing the prompt")
    if body.get("suffix"):
        raise unsupported("suffix", "insertion (suffix)")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise unsupported(key, "a non-zero penalty")
    if body.get("logit_bias"):
        raise unsupported("logit_bias", "logit_bias")
    for key in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(key) not in (None, [], "none"):
            raise unsupported(key, "tool calling")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise unsupported("response_format", "a response format other than text")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > 4:
        raise bad("stop must be a string or a list of up to 4 strings", "stop", "invalid_type")
    return [s for s in stops if s]


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream", "invalid_type")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options", "invalid_type")
    return stream, bool(options.get("include_usage"))


SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes
ROLES = ("system", "user", "assistant")


def _sampling(body: dict) -> SamplingParams:
    """Temperatures in [0, GREEDY_BELOW) decode greedily (toolkit.engine.sampling): no setting overflows."""
    return SamplingParams(temperature=_number(body, "temperature", 1.0, minimum=0.0, maximum=2.0),
                          top_k=_number(body, "top_k", 0, int, minimum=0, maximum=2**31 - 1),
                          top_p=_number(body, "top_p", 1.0, minimum=0.0, maximum=1.0) or 1e-9,
                          seed=_number(body, "seed", None, int, minimum=SEED_RANGE[0], maximum=SEED_RANGE[1]))


def _max_tokens(body: dict, key: str, prompt_len: int, default: int | None, limit: int, max_seq_len: int,
                prompt_param: str) -> int:
    room = max_seq_len - prompt_len
    if room <= 0:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this server's context is {max_seq_len} tokens "
                       "(prompt + max_tokens)", param=prompt_param, code="context_length_exceeded")
    value = body.get(key)
    if value is None:
        return min(default or limit, limit, room)
    value = _number(body, key, None, int)
    if value <= 0:
        raise bad(f"{key} must be >= 1, got {value}", key)
    if value > limit:
        raise bad(f"{key} must be <= {limit} on this server, got {value}", key)
    if value > room:
        raise APIError(400, f"prompt ({prompt_len} tokens) + {key} ({value}) exceeds this server's context of "
                       f"{max_seq_len} tokens", param=key, code="context_length_exceeded")
    return value


PREFIX_CHARS_PER_TOKEN = 64  # a long text is first tokenized only this many characters per context token


def _tokenize(tokenizer, text: str, param: str, max_seq_len: int, **kwargs) -> list[int]:
    """Token ids of `text`; a 400 when the tokenizer refuses it. A text too long for the context is refused as soon
    as that is known: one of more than PREFIX_CHARS_PER_TOKEN * max_seq_len characters is first tokenized only that
    far, and refused if that prefix alone has more than twice the context (with that margin, what the cut changes
    at its end cannot matter), instead of tokenizing megabytes to count them."""
    try:
        cut = PREFIX_CHARS_PER_TOKEN * max_seq_len
        if len(text) > cut:
            counted = len(tokenizer(text[:cut], **kwargs).input_ids)
            if counted > 2 * max_seq_len + 16:
                raise APIError(400, f"the prompt has more than {counted} tokens; this server's context is "
                               f"{max_seq_len} tokens (prompt + max_tokens)", param=param,
                               code="context_length_exceeded")
        return tokenizer(text, **kwargs).input_ids
    except APIError:
        raise
    except Exception as exc:  # text the tokenizer cannot take (a 400 for this request, not a 500)
        raise bad(f"{param} could not be tokenized: {_short(str(exc), 200)}", param)


def parse_completion(body: dict, tokenizer, max_tokens_limit: int, max_seq_len: int) -> ParsedRequest:
    _refuse_unsupported(body, _COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt is empty", "prompt")
        ids = _tokenize(tokenizer, prompt, "prompt", max_seq_len)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = len(tokenizer)
        if not all(0 <= t < vocab for t in prompt):
            raise bad(f"prompt token ids must be in [0, {vocab})", "prompt")
        ids = list(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise unsupported("prompt", "a batch of prompts in one request (send one request per prompt)")
    else:
        raise bad("prompt must be a non-empty string or list of token ids", "prompt", "invalid_type")
    if not ids:
        raise bad("prompt encodes to no tokens", "prompt")
    stream, include_usage = _stream(body)
    return ParsedRequest(ids, _max_tokens(body, "max_tokens", len(ids), 16, max_tokens_limit, max_seq_len, "prompt"),
                         _sampling(body), _stop(body), stream, include_usage)


def parse_chat(body: dict, tokenizer, max_tokens_limit: int, max_seq_len: int) -> ParsedRequest:
    _refuse_unsupported(body, _CHAT)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages", "invalid_type")
    conversation = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a role", f"messages[{i}]", "invalid_type")
        if message["role"] not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {_short(message['role'])}",
                      f"messages[{i}].role")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise unsupported(f"messages[{i}].content", "a content part other than text")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string", f"messages[{i}].content", "invalid_type")
        conversation.append({"role": message["role"], "content": content})
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template", param="messages",
                       code="chat_template_missing")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's own checks (role order, unknown roles) raise template errors
        raise bad(f"the chat template refused these messages: {exc}", "messages")
    ids = _tokenize(tokenizer, text, "messages", max_seq_len, add_special_tokens=False)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream, include_usage = _stream(body)
    return ParsedRequest(ids, _max_tokens(body, key, len(ids), None, max_tokens_limit, max_seq_len, "messages"),
                         _sampling(body), _stop(body), stream, include_usage)
