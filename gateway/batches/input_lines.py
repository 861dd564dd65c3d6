"""A batch's input file, line by line: JSONL whose every line is `{"custom_id", "method": "POST", "url", "body"}`,
`url` the batch's endpoint, `custom_id` unique, `body` an object that asks for no stream. Checked whole when the
batch is created (a bad line is a 400 naming it, `param` `input_file_id`), then read again by the runner, which
validates each body against the endpoint's schema as the route would (a bad body is that line's 400, in the error
file). Blank lines are skipped, as OpenAI's parser skips them; lines keep their numbers in the file (1-based).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from tokenweir.common.http.errors import APIError

_FIELDS = {"custom_id", "method", "url", "body"}
MAX_CUSTOM_ID = 512


@dataclass(frozen=True, slots=True)
class InputLine:
    number: int  # the line's number in the file (1-based)
    custom_id: str
    raw_body: bytes  # the line's body as JSON: the runner parses it as a request body is parsed
    model: str | None  # the model it names (its pool's free slots pace it), if a string


def parse_input(content: str, endpoint: str, max_lines: int) -> list[InputLine]:
    """Every request line of `content`, checked; APIError 400 naming the first bad line."""
    lines: list[InputLine] = []
    seen: set[str] = set()
    for number, text in enumerate(content.splitlines(), start=1):
        if not text.strip():
            continue
        line = _parse_line(number, text, endpoint)
        if line.custom_id in seen:
            raise _bad(number, f"custom_id '{line.custom_id}' is used by an earlier line; each must be unique.")
        seen.add(line.custom_id)
        lines.append(line)
        if len(lines) > max_lines:
            raise _bad(number, f"the file has more than {max_lines} requests, the most one batch may hold.")
    if not lines:
        raise APIError(400, "The input file has no request lines.", "invalid_input_file", param="input_file_id")
    return lines


def _parse_line(number: int, text: str, endpoint: str) -> InputLine:
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise _bad(number, "it is not valid JSON.") from None
    if not isinstance(data, dict):
        raise _bad(number, "it must be a JSON object.")
    if missing := sorted(_FIELDS - data.keys()):
        raise _bad(number, f"it lacks {', '.join(missing)} (each line needs custom_id, method, url and body).")
    if extra := sorted(data.keys() - _FIELDS):
        raise _bad(number, f"unknown field(s) {', '.join(extra)}: a line has only custom_id, method, url and body.")
    custom_id, body = data["custom_id"], data["body"]
    if not isinstance(custom_id, str) or not 0 < len(custom_id) <= MAX_CUSTOM_ID:
        raise _bad(number, f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters.")
    if data["method"] != "POST":
        raise _bad(number, "method must be 'POST'.")
    if data["url"] != endpoint:
        raise _bad(number, f"url {_shown(data['url'])} is not the batch's endpoint '{endpoint}'.")
    if not isinstance(body, dict):
        raise _bad(number, "body must be a JSON object (the request's body).")
    if body.get("stream"):
        raise _bad(number, "body asks for a stream; batch requests are answered whole (omit stream).")
    model = body.get("model")
    return InputLine(number, custom_id, orjson.dumps(body), model if isinstance(model, str) else None)


def _bad(number: int, why: str) -> APIError:
    return APIError(400, f"Line {number} of the input file is invalid: {why}", "invalid_input_file", "input_file_id")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
