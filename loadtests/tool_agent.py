"""A two-tool agent loop against `tokenweir serve` on the default model, with the OpenAI SDK (and the OpenAI Agents SDK
where it is installed: `pip install openai-agents`): every tool call the model chooses (tool_choice left out, "auto")
is checked against its function's JSON Schema with `jsonschema`, streamed and not, with parallel calls allowed and not.

    .venv/bin/python loadtests/tool_agent.py --runs 50 [--url http://127.0.0.1:8000 --key tw-...]

Each run asks one of four questions, runs the calls the model makes (the weather is made up, the sums are real), sends
the results back as tool turns, and goes on until the model answers in text (at most --turns turns). SmolLM2-135M
seldom starts a call unprompted, so besides the plain runs ("as is"), "nudged" runs raise the logit of "<" (the
start of hermes' `<tool_call>`) by 8 on the first turn, with OpenAI's own logit_bias: what follows the opening is the
model's, kept valid by the engine's grammar. The table counts runs, calls, calls that validate, parallel calls and
the answers' finish reasons; a streamed call that max_tokens cut part-way (its arguments already shown, as OpenAI
streams them) is counted apart and not run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import jsonschema
import openai
from pydantic import Field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from loadtests.bench_routing import MODEL, Serve  # noqa: E402

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTIONS = ["What is the weather in Paris?", "What is 12.5 plus 30?", "Get the weather in Tokyo in fahrenheit.",
             "What is 7 plus 8, and how warm is it in Rome?"]  # fmt: skip


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def run_tool(name: str, arguments: dict) -> str:
    if name == "add":
        return json.dumps({"sum": arguments["a"] + arguments["b"]})
    return json.dumps({"city": arguments["city"], "temperature": 18, "unit": arguments["unit"], "sky": "clear"})


@dataclass
class Tally:
    runs: int = 0
    runs_with_calls: int = 0
    calls: int = 0
    valid: int = 0
    parallel: int = 0
    turns: int = 0
    cut: int = 0
    finish: Counter = field(default_factory=Counter)

    def row(self, name: str) -> str:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.finish.items()))
        return (
            f"| {name} | {self.runs} | {self.runs_with_calls} | {self.calls} | {self.valid} | {self.parallel} | "
            f"{self.cut} | {self.turns} | {reasons} |"
        )


def ask(client: openai.OpenAI, messages: list, stream: bool, **options) -> tuple[dict, str]:
    """One turn: the assistant message (content and calls, assembled from the deltas when streamed) and why it ended."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **options).choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, stream=True, **options):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(
                    d.index, {"id": d.id, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["function"]["name"] += d.function.name or ""
                call["function"]["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


def agent_run(client: openai.OpenAI, tally: Tally, seed: int, stream: bool, nudge: dict, parallel: bool, turns: int):
    messages = [{"role": "user", "content": QUESTIONS[seed % len(QUESTIONS)]}]
    tally.runs += 1
    called = False
    for turn in range(turns):
        bias = {"logit_bias": nudge} if turn == 0 and nudge else {}
        message, finish = ask(
            client, messages, stream, max_tokens=80, temperature=0.7, seed=seed, parallel_tool_calls=parallel, **bias
        )
        tally.turns += 1
        tally.finish[finish] += 1
        calls = message.get("tool_calls") or []
        if finish == "length" and calls and not parses(calls[-1]["function"]["arguments"]):
            tally.cut += 1  # a stream shows a call as it comes: max_tokens can end it part-way, as OpenAI's can
            calls = calls[:-1]
        if not calls:
            break
        called = True
        tally.calls += len(calls)
        tally.parallel += len(calls) > 1
        messages.append(message)
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            jsonschema.validate(arguments, SCHEMAS[call["function"]["name"]])
            tally.valid += 1
            messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": run_tool(call["function"]["name"], arguments)}
            )
    tally.runs_with_calls += called


def agents_sdk(url: str, key: str, runs: int, nudge: dict) -> Tally | None:
    """The same loop through the OpenAI Agents SDK's chat-completions model, where the package is installed. Its
    model settings apply to every turn, the nudge too: the answers after the calls are the nudged model's, not
    checked; the calls the SDK ran are."""
    try:
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    except ImportError:
        return None
    set_tracing_disabled(True)
    tally = Tally()
    made: list[tuple[str, dict]] = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=40)], unit: Literal["celsius", "fahrenheit"]) -> str:
        """The weather in a city."""
        made.append(("get_weather", {"city": city, "unit": unit}))
        return run_tool("get_weather", {"city": city, "unit": unit})

    @function_tool
    def add(a: float, b: float) -> str:
        """Add two numbers."""
        made.append(("add", {"a": a, "b": b}))
        return run_tool("add", {"a": a, "b": b})

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    model = OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    settings = ModelSettings(temperature=0.7, max_tokens=60, extra_args={"logit_bias": nudge})
    agent = Agent(
        name="helper", instructions="Use the tools.", tools=[get_weather, add], model=model, model_settings=settings
    )

    async def main() -> None:
        for seed in range(runs):
            before = len(made)
            tally.runs += 1
            try:
                result = await Runner.run(agent, QUESTIONS[seed % len(QUESTIONS)], max_turns=3)
                tally.turns += len(result.raw_responses)
                tally.finish["answered" if isinstance(result.final_output, str) else "other"] += 1
            except Exception as e:  # the SDK's own refusals (max_turns, an empty answer): counted, the run goes on
                tally.finish[type(e).__name__] += 1
            tally.runs_with_calls += len(made) > before

    asyncio.run(main())
    for name, arguments in made:
        tally.calls += 1
        jsonschema.validate(arguments, SCHEMAS[name])
        tally.valid += 1
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per setting")
    parser.add_argument("--turns", type=int, default=3, help="most turns of one run")
    parser.add_argument("--url", help="a running gateway (default: start `tokenweir serve` here)")
    parser.add_argument("--key", help="its API key (with --url)")
    args = parser.parse_args()
    serve = None
    if args.url is None:
        tmp = Path(tempfile.mkdtemp(prefix="tool-agent-"))
        config = tmp / "tokenweir.yaml"
        config.write_text("{}")
        serve = Serve(config, engines=1, store=tmp / "tw.db")
        print("starting tokenweir serve ...", flush=True)
        serve.wait_ready()
        args.url, args.key = serve.url, serve.team_keys({"agents": {}})["agents"]
    try:
        from tokenweir.common.text.model_files import default_model_path
        from tokenweir.common.text.tokenizer import Tokenizer

        nudge = {str(Tokenizer.from_gguf(default_model_path()).encode("<")[0]): 8}
        client = openai.OpenAI(base_url=args.url + "/v1", api_key=args.key, max_retries=0, timeout=120)
        settings = [("as is", {}, True), ("nudged", nudge, True), ("nudged, parallel_tool_calls false", nudge, False)]
        rows = []
        for name, bias, parallel in settings:
            for stream in (False, True):
                tally = Tally()
                for seed in range(args.runs):
                    agent_run(client, tally, seed, stream, bias, parallel, args.turns)
                label = f"{name}, {'streamed' if stream else 'whole'}"
                print(f"{label}: {tally.runs} runs, {tally.calls} calls, {tally.valid} valid", flush=True)
                rows.append(tally.row(label))
        sdk = agents_sdk(args.url, args.key, args.runs, nudge)
        rows.append(sdk.row("Agents SDK, nudged") if sdk else "| Agents SDK | not installed | | | | | | | |")
        print("\n| setting | runs | runs with calls | calls | valid | parallel | cut by max_tokens | turns | finish |")
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    finally:
        if serve is not None:
            serve.stop()


if __name__ == "__main__":
    main()
