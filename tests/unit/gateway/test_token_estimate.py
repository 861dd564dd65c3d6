"""The prompt estimate counts by a pass per kind of piece: it must equal the rule as the module docstring words it,
applied one piece at a time (the reference below), on texts mixing every kind of character it treats apart."""

from __future__ import annotations

import random
import re

import pytest

from tokenweir.gateway.openai.token_count import estimate_tokens

_PIECES = re.compile(r"[A-Za-z]+|\s+|.", re.DOTALL)


def piece_by_piece(text: str) -> int:
    n = 0
    for m in _PIECES.finditer(text):
        piece = m.group()
        if piece[0].isascii() and piece[0].isalpha():
            n += (len(piece) + 3) // 4 + max(0, len(piece) - 8) // 4 + len(re.findall(r"[a-z][A-Z]", piece))
        elif piece[0].isspace():
            n += 0 if piece == " " else (len(piece) + 3) // 4
        else:
            n += max(1, len(piece.encode()) - 1)
    return n


# ASCII letters of both cases, a space, other ASCII and Unicode whitespace, punctuation and digits, and non-ASCII
# characters of 2, 3 and 4 UTF-8 bytes (a letter, CJK, an emoji)
ALPHABET = "aAzZqQ  \n\t\r\u00a0\u3000\u2028\x85.,{}\"'09-é\u00ff中\u20ac😀"


@pytest.mark.parametrize("seed", range(5))
def test_estimate_is_the_piecewise_rule(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(2000):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 80)))
        assert estimate_tokens(text) == piece_by_piece(text), text


def test_estimate_on_prose_and_code() -> None:
    for text in ("", " ", "hello", "Hello, world!  \n\n  def fooBarBaz(x):\n    return x", "Supercalifragilistic " * 9):
        assert estimate_tokens(text) == piece_by_piece(text)
