"""The Responses API through `tokenweir serve` on the default model, with the OpenAI SDK, one line per check:
create, stream, retrieve, delete, previous_response_id over three turns, structured text.format, a function tool,
another team's id, and each response's event and bill.

    .venv/bin/python loadtests/responses_tour.py [--url http://127.0.0.1:8000 --key tw-... --other-key tw-...
                                                  --events PATH]

Without --url it starts `tokenweir serve` here, with two teams.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jsonschema  # noqa: E402
import openai  # noqa: E402

from loadtests.bench_routing import MODEL, Serve  # noqa: E402

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
}


def check(what: str, ok: bool, shown: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {what}{': ' if shown != '' else ''}{shown}", flush=True)
    if not ok:
        raise SystemExit(1)


def tour(client: openai.OpenAI, other: openai.OpenAI, events: Path | None) -> None:
    first = client.responses.create(model=MODEL, input="Name a large city in France.", max_output_tokens=24)
    check("create: a completed response with text", first.status in ("completed", "incomplete"), first.output_text)
    check(
        "usage as OpenAI reports it", first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    )
    second = client.responses.create(
        model=MODEL, input="And one in Italy?", previous_response_id=first.id, max_output_tokens=24
    )
    third = client.responses.create(
        model=MODEL, input="Which of the two is larger?", previous_response_id=second.id, max_output_tokens=24
    )
    check("previous_response_id: the third turn's prompt holds the first two", third.usage.input_tokens >
          second.usage.input_tokens > first.usage.input_tokens, [first.usage.input_tokens, second.usage.input_tokens,
          third.usage.input_tokens])  # fmt: skip
    items = client.responses.input_items.list(third.id)
    check("input_items: every turn's items", len(items.data) >= 5, len(items.data))
    got = client.responses.retrieve(third.id)
    check("retrieve: the stored response", got.id == third.id and got.output_text == third.output_text)

    events_seen, streamed = [], None
    with client.responses.stream(model=MODEL, input="Say hello in French.", max_output_tokens=16) as stream:
        for event in stream:
            events_seen.append(event.type)
            if event.type in ("response.completed", "response.incomplete"):
                streamed = event.response
    order = [e for e in events_seen if not e.endswith(".delta")]
    check("stream: OpenAI's event order", events_seen[:2] == ["response.created", "response.in_progress"]
          and events_seen[-1] in ("response.completed", "response.incomplete"), order)  # fmt: skip

    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    structured = client.responses.create(
        model=MODEL, input="Give a city and its country as JSON.", text={"format": fmt}, max_output_tokens=60
    )
    if structured.status == "completed":
        jsonschema.validate(json.loads(structured.output_text), CITY)
    check("text.format json_schema: the answer validates", structured.status == "completed", structured.output_text)

    called = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice="required",
        max_output_tokens=60,
    )  # fmt: skip
    calls = [o for o in called.output if o.type == "function_call"]
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    check("a function tool: its calls validate", bool(calls), [(c.name, c.arguments) for c in calls])
    answered = client.responses.create(
        model=MODEL, previous_response_id=called.id, tools=[WEATHER_TOOL], max_output_tokens=24,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 18}'}],
    )  # fmt: skip
    check("the call's output continues the conversation", answered.status in ("completed", "incomplete"))

    for name, attempt in (
        ("retrieve", lambda: other.responses.retrieve(first.id)),
        ("delete", lambda: other.responses.delete(first.id)),
        ("input_items", lambda: other.responses.input_items.list(first.id)),
        (
            "previous_response_id",
            lambda: other.responses.create(model=MODEL, input="hi", previous_response_id=first.id),
        ),
    ):
        try:
            attempt()
            check(f"another team's id on {name}: 404", False)
        except openai.NotFoundError:
            check(f"another team's id on {name}: 404", True)
    client.responses.delete(first.id)
    try:
        client.responses.retrieve(first.id)
        check("delete: then 404", False)
    except openai.NotFoundError:
        check("delete: then 404", True)

    if events is not None:
        time.sleep(1.0)  # the last events' lines
        rows = [json.loads(line) for line in events.read_text().splitlines()]
        served = [r for r in rows if r.get("kind") == "responses" and r.get("status") == "ok"]
        made = [first, second, third, streamed, structured, called, answered]
        billed = sum((r.get("prompt_tokens") or 0) + (r.get("completion_tokens") or 0) for r in served)
        answered_tokens = sum(r.usage.total_tokens for r in made if r is not None)
        check("one event per response (kind responses), billed as the usage answered", len(served) == len(made)
              and billed == answered_tokens, f"{len(served)} events, {billed} tokens billed, {answered_tokens} in the "
              "answers' usage")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--key")
    parser.add_argument("--other-key")
    parser.add_argument("--events", type=Path)
    args = parser.parse_args()
    serve = None
    if args.url is None:
        tmp = Path(tempfile.mkdtemp(prefix="responses-tour-"))
        args.events = tmp / "events.jsonl"
        (tmp / "tokenweir.yaml").write_text(json.dumps({"events": {"path": str(args.events)}}))
        serve = Serve(tmp / "tokenweir.yaml", engines=1, store=tmp / "tw.db")
        print("starting tokenweir serve ...", flush=True)
        serve.wait_ready()
        keys = serve.team_keys({"red": {}, "blue": {}})
        args.url, args.key, args.other_key = serve.url, keys["red"], keys["blue"]
    try:
        client = openai.OpenAI(base_url=args.url + "/v1", api_key=args.key, max_retries=0, timeout=300)
        other = openai.OpenAI(base_url=args.url + "/v1", api_key=args.other_key, max_retries=0, timeout=300)
        tour(client, other, args.events)
    finally:
        if serve is not None:
            serve.stop()


if __name__ == "__main__":
    main()
