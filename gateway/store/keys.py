"""API key secrets: shown once, stored only as a (peppered) sha256 and a short visible prefix.

Two kinds: the keys the gateway issues (`tw-` + 43 base64url characters), and the operator's own admin secret
(TOKENWEIR_ADMIN_KEY), which may come from a vault in any format as long as it is strong (`secret_weakness`).
Both are looked up the same way, by the hash of the whole string.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
from collections import Counter

SECRET_PREFIX = "tw-"
VISIBLE_CHARS = 7  # "tw-AbCd": enough to tell keys apart in listings and logs, useless to an attacker
# An operator's secret has no public prefix of ours: show only 4 of its characters (<= 28 bits of >= 128).
VISIBLE_CHARS_OTHER = 4
# token_urlsafe(32) is 43 characters of base64url: the format of every key the gateway issues.
_SECRET_RE = re.compile(r"tw-[A-Za-z0-9_-]{43}")
# An operator's secret: printable ASCII without spaces (it travels in an HTTP header, and a space would be cut there).
_OTHER_RE = re.compile(r"[\x21-\x7e]+")
MIN_SECRET_CHARS = 32
MAX_SECRET_CHARS = 512
MIN_SECRET_BITS = 128
SECRET_RULE = (
    f"{MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} printable ASCII characters without spaces, with at least "
    f"{MIN_SECRET_BITS} bits of estimated entropy (length x the Shannon entropy of its characters, or of the "
    "steps between them, whichever is lower; `openssl rand -base64 32` makes one)"
)


def generate_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def _total_bits(seq) -> float:
    n = len(seq)
    return -sum(c * math.log2(c / n) for c in Counter(seq).values()) if n else 0.0


def estimated_bits(secret: str) -> float:
    """Length x the Shannon entropy of the string's own character frequencies, or of the steps between neighbouring
    characters where that is lower: 0 for "aaaa...", 2 bits a character for "abcdabcd...", near 0 for "abcdefg...",
    about 5 for a random base64 string. An estimate, not a proof (a keyboard walk or a phrase can pass), but it
    refuses repeats, runs, short alphabets and short strings, while random secrets pass with room to spare."""
    steps = [ord(b) - ord(a) for a, b in zip(secret, secret[1:], strict=False)]
    return max(0.0, min(_total_bits(secret), _total_bits(steps)))


def secret_weakness(secret: str) -> str | None:
    """Why `secret` may not be an operator's admin secret (None: it may), without quoting any of it."""
    if not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS:
        return f"got {len(secret)} characters"
    if not _OTHER_RE.fullmatch(secret):
        return "got a space, a control or a non-ASCII character"
    bits = estimated_bits(secret)
    if bits < MIN_SECRET_BITS:
        return f"got about {bits:.0f} bits ({len(set(secret))} distinct characters in {len(secret)})"
    return None


def is_well_formed(secret: str) -> bool:
    """Whether `secret` could be a key of this gateway: one it issued, or a strong operator's admin secret."""
    return bool(_SECRET_RE.fullmatch(secret)) or secret_weakness(secret) is None


def visible_prefix(secret: str) -> str:
    return secret[: VISIBLE_CHARS if _SECRET_RE.fullmatch(secret) else VISIBLE_CHARS_OTHER]


def masked(secret: str) -> str:
    """What error messages may show of a presented secret: its prefix, never the rest."""
    return visible_prefix(secret) + "****"


def hash_secret(secret: str, pepper: bytes | None = None) -> str:
    """A pepper (server-side secret, not in the database) makes a leaked table useless without it."""
    data = secret.encode()
    if pepper:
        return hmac.new(pepper, data, hashlib.sha256).hexdigest()
    return hashlib.sha256(data).hexdigest()


def hashes_match(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
