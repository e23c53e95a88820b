"""OpenAI request parsing and error objects, without I/O (peer/api/http.py serves them).

Parses the fields prefixswarm supports (model, prompt or messages, max_tokens /
max_completion_tokens, temperature, top_p, seed, stop, stream, stream_options, n=1) and
refuses, with the parameter named, the ones that would change an answer's meaning.
"""

from __future__ import annotations

import json
from typing import Any

from peer.engine.api import InvalidRequest, SamplingParams

MAX_BODY_BYTES = 4 << 20  # the longest prompt the engine accepts, JSON-escaped, fits easily
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
DEFAULT_CHAT_MAX_TOKENS = 256  # OpenAI's is "until the context is full": too long on a CPU
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; pass 0 for greedy (reproducible) answers
RETRY_AFTER_S = 1  # a 429 or 503 without a better estimate: clients retry after a second
MAX_CACHE_SALT_CHARS = 256  # vLLM's cache_salt is an opaque string; longer is a mistake
# Options that would change the answer's meaning: refused unless at their default.
# Other unknown options (user, metadata, penalties at 0, ...) are ignored, as vLLM does.
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
}


class ApiError(Exception):
    """An error answered as an OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, dict(headers or {})
        if status in (429, 503) and "retry-after" not in {k.lower() for k in self.headers}:
            self.headers["Retry-After"] = str(RETRY_AFTER_S)  # every 429 and 503 says when

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message, "type": self.type, "param": self.param, "code": self.code
            }
        }


def _number(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{name}' must be a number, got {value!r}", param=name)
    return float(value)


def _integer(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ApiError(400, f"'{name}' must be an integer, got {value!r}", param=name)
    return value


def _text(value: str, param: str) -> str:
    """`value` if it is valid Unicode text (JSON admits lone surrogates such as "\\ud800")."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            400, f"'{param}' is not valid Unicode text: {exc.reason} at {exc.start}", param=param,
            code="invalid_value",
        ) from None
    return value


def parse_cache_salt(body: dict[str, Any]) -> bytes | None:
    """The request's `cache_salt` (vLLM's extension: a private cache namespace), or None."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ApiError(
            400, f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters",
            param="cache_salt", code="invalid_value",
        )
    return _text(salt, "cache_salt").encode("utf-8")


def parse_params(body: dict[str, Any], chat: bool) -> SamplingParams:
    """SamplingParams from OpenAI fields; ApiError(400) naming the bad parameter."""
    for name, defaults in _UNSUPPORTED_DEFAULTS.items():
        if name in body and body[name] not in defaults:
            raise ApiError(400, f"'{name}' is not supported by prefixswarm", param=name)
    n = _integer(body, "n")
    if n not in (None, 1):
        raise ApiError(400, f"only n=1 is supported, got n={n}", param="n")
    max_tokens = _integer(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (_text(stop, "stop"),)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(_text(s, "stop") for s in stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
    params = SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE),
        top_p=_number(body, "top_p", 1.0),
        seed=_integer(body, "seed"),
        stop=stops,
    )
    try:
        params.validate()
    except InvalidRequest as exc:
        param = next((p for p in ("temperature", "top_p", "seed", "stop") if p in str(exc)), None)
        raise ApiError(400, str(exc), param=param or "max_tokens", code="invalid_value") from exc
    return params


def parse_prompt(body: dict[str, Any], chat: bool) -> str | list[dict[str, str]] | list[int]:
    """The prompt: text, token ids, or chat messages with text content."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        out = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, "each message needs a string 'role'", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text is understood
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise ApiError(400, "only text content parts are supported", param="messages")
                content = "".join(str(p.get("text", "")) for p in content)
            if not isinstance(content, str):
                raise ApiError(400, "each message needs text 'content'", param="messages")
            role = _text(m["role"], "messages")
            out.append({"role": role, "content": _text(content, "messages")})
        return out
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text(prompt, "prompt")
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        return list(prompt)
    raise ApiError(
        400, "'prompt' must be a string, a list of one string, or token ids", param="prompt"
    )


def parse_body(data: bytes) -> dict[str, Any]:
    """A request body as a JSON object; ApiError(400) otherwise."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError:  # the C decoder recurses once per nesting level
        raise ApiError(400, "the body's JSON is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


def usage(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The OpenAI usage object, cached tokens included."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
