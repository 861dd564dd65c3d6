"""The KV transfer key the tests' engines share (a kv_consumer fetches only what a producer signed with it, or a
producer it lists), and a producer's answer pointed somewhere else and signed again, as a producer of the test's own
would sign it."""

from dataclasses import replace

from tokenweir.engine.kv_transfer.params import RemotePrefill, producer_answer
from tokenweir.engine.kv_transfer.trust import signed

KV_KEY = "tests-kv-transfer-key-0123456789abcdef"


def redirected(answer: dict, port: int, key: str | None = KV_KEY) -> dict:
    """`answer` naming 127.0.0.1:`port` instead, signed with `key` (None: unsigned)."""
    remote = replace(RemotePrefill.parse(answer), host="127.0.0.1", port=port)
    return producer_answer(signed(remote, key, 30.0))
