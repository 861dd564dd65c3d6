"""API key secrets: shown once, stored only as a (peppered) sha256 and a short visible prefix."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

SECRET_PREFIX = "tw-"
VISIBLE_CHARS = 7  # "tw-AbCd": enough to tell keys apart in listings and logs, useless to an attacker
# token_urlsafe(32) is 43 characters of base64url; anything else cannot be one of our keys.
_SECRET_RE = re.compile(r"^tw-[A-Za-z0-9_-]{43}$")


def generate_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def is_well_formed(secret: str) -> bool:
    return bool(_SECRET_RE.match(secret))


def visible_prefix(secret: str) -> str:
    return secret[:VISIBLE_CHARS]


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
