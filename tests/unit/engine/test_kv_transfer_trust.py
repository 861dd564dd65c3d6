"""Which producers a kv_consumer trusts (engine/kv_transfer/trust.py): a producer's answer signed with the engines' key
verifies; a field changed after signing, another key, no signature or an expired one does not; a consumer with no key
trusts only the producers it lists, and with neither trusts none. The key reaches the engine from its env or a file,
never from its command line."""

import argparse
import dataclasses
import time

import pytest

from tests.support.kv_transfer import KV_KEY
from tokenweir.common.engine_flags import KV_TRANSFER_KEY_ENV
from tokenweir.engine.config import KVTransferConfig
from tokenweir.engine.flags import kv_transfer, parse_args, parse_kv_transfer
from tokenweir.engine.kv_transfer.params import RemotePrefill, producer_answer
from tokenweir.engine.kv_transfer.trust import CLOCK_SKEW_S, ProducerTrust, signed

REMOTE = RemotePrefill("10.0.0.7", 14579, "10.0.0.7:123:abc", "f" * 32, 70)


def through_the_wire(remote: RemotePrefill) -> RemotePrefill:
    """As a consumer sees it: the producer's answer as a request's kv_transfer_params."""
    return RemotePrefill.parse(producer_answer(remote))


def test_a_signed_answer_verifies_under_the_engines_key():
    answer = producer_answer(signed(REMOTE, KV_KEY, 30.0))
    assert set(answer) >= {"transfer_token", "transfer_expires"}
    assert ProducerTrust(KV_KEY).refusal(RemotePrefill.parse(answer)) is None


@pytest.mark.parametrize(
    "change",
    [
        {"host": "10.0.0.8"},
        {"port": 22},
        {"engine_id": "someone-else"},
        {"transfer_id": "e" * 32},
        {"num_tokens": 69},
        {"expires": 2**40},
    ],
)
def test_a_field_changed_after_signing_is_refused(change):
    forged = dataclasses.replace(signed(REMOTE, KV_KEY, 30.0), **change)
    assert "not signed with this engine's key" in ProducerTrust(KV_KEY).refusal(through_the_wire(forged))


def test_a_signature_under_another_key_is_refused():
    other = signed(REMOTE, "another-key-of-32-characters-xxx", 30.0)
    assert "not signed with this engine's key" in ProducerTrust(KV_KEY).refusal(through_the_wire(other))


def test_an_unsigned_answer_is_refused_by_a_consumer_with_a_key():
    unsigned = through_the_wire(signed(REMOTE, None, 30.0))
    assert unsigned.token is None
    assert "is not signed" in ProducerTrust(KV_KEY).refusal(unsigned)


def test_a_token_that_is_no_hex_digest_is_refused_not_raised():
    odd = dataclasses.replace(signed(REMOTE, KV_KEY, 30.0), token="é" * 64)
    assert "not signed with this engine's key" in ProducerTrust(KV_KEY).refusal(odd)
    with pytest.raises(ValueError, match="transfer_token"):
        RemotePrefill.parse({**producer_answer(REMOTE), "transfer_token": 7})


def test_a_signature_past_its_expiry_is_refused():
    now = time.time()
    old = through_the_wire(signed(REMOTE, KV_KEY, 30.0, now=now - 100))
    trust = ProducerTrust(KV_KEY)
    assert "expired" in trust.refusal(old, now=now)
    assert trust.refusal(old, now=old.expires + CLOCK_SKEW_S - 1) is None  # the engines' clocks may differ a little


def test_a_consumer_with_neither_key_nor_producers_refuses_even_a_signed_answer():
    trust = ProducerTrust(None)
    assert not trust.trusts_any
    assert "no key" in trust.refusal(through_the_wire(signed(REMOTE, KV_KEY, 30.0)))


def test_listed_producers_are_trusted_unsigned_and_no_other_address_is():
    trust = ProducerTrust(None, ["10.0.0.7:14579"])
    assert trust.refusal(REMOTE) is None
    assert trust.refusal(dataclasses.replace(REMOTE, port=14580)) is not None
    assert trust.refusal(dataclasses.replace(REMOTE, host="10.0.0.70")) is not None


def args_of(*argv: str) -> argparse.Namespace:
    return parse_args(["--kv-transfer-config", '{"kv_role": "kv_consumer"}', *argv])


def test_the_key_comes_from_the_env_or_a_file_and_the_producers_from_their_flag(monkeypatch, tmp_path):
    monkeypatch.delenv(KV_TRANSFER_KEY_ENV, raising=False)
    assert kv_transfer(args_of()).transfer_key is None
    monkeypatch.setenv(KV_TRANSFER_KEY_ENV, KV_KEY)
    assert kv_transfer(args_of()).transfer_key == KV_KEY
    key_file = tmp_path / "kv.key"
    key_file.write_text("from-the-file-0123456789\n")
    assert kv_transfer(args_of("--kv-transfer-key-file", str(key_file))).transfer_key == "from-the-file-0123456789"
    config = kv_transfer(args_of("--kv-producers", "10.0.0.7:14579, engine-b:9000"))
    assert config.kv_producers == ("10.0.0.7:14579", "engine-b:9000")
    assert KV_KEY not in repr(config)
    with pytest.raises(SystemExit):
        args_of("--kv-producers", "10.0.0.7")


def test_the_key_is_refused_on_the_command_line_and_when_short(monkeypatch):
    with pytest.raises(argparse.ArgumentTypeError, match="secret"):
        parse_kv_transfer(f'{{"kv_role": "kv_consumer", "transfer_key": "{KV_KEY}"}}')
    monkeypatch.setenv(KV_TRANSFER_KEY_ENV, "short")
    with pytest.raises(AssertionError, match="16 characters"):
        kv_transfer(args_of())
    with pytest.raises(AssertionError, match="kv_producers"):
        KVTransferConfig(kv_producers=("no-port",))
