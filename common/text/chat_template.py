"""A model's chat template compiled as transformers compiles it (a sandboxed jinja2 environment with trim/lstrip
blocks, loop controls, and its `raise_exception`, `tojson` and `strftime_now`), so the prompt we render is the one
HF renders for the same messages."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


def compile_chat_template(source: str) -> jinja2.Template:
    """Same environment as transformers' chat templates: sandboxed, trim/lstrip, raise_exception, tojson."""

    def raise_exception(message: str) -> NoReturn:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | str | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def template_reads(source: str, variable: str) -> bool:
    """Whether a template uses `variable` (e.g. `tools`: it renders the functions itself), read from its syntax tree
    rather than its text, so a comment or a string that mentions the word does not count."""
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    return variable in jinja2.meta.find_undeclared_variables(env.parse(source))
