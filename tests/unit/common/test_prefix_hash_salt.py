"""The prefix cache's hash chain under a cache_salt (common/text/prefix_hash.py): a salt gives a prompt a chain of its
own from the first block on, the same one in every process, and no salt keeps the chain it always had."""

import os
import subprocess
import sys

from tokenweir.common.text.prefix_hash import ROOT, block_hashes, chain, probe, root

TOKENS = list(range(100, 150))  # 3 full blocks of 16


def test_a_salted_chain_differs_from_the_unsalted_one_and_from_another_salts_at_every_block():
    plain, a, b = block_hashes(TOKENS, 16), block_hashes(TOKENS, 16, salt="team-a"), block_hashes(TOKENS, 16, salt="b")
    assert len(plain) == len(a) == len(b) == 3
    assert not set(a) & set(plain) and not set(a) & set(b) and not set(b) & set(plain)


def test_the_same_salt_gives_the_same_chain_and_no_salt_keeps_the_former_one():
    assert block_hashes(TOKENS, 16, salt="team-a") == block_hashes(TOKENS, 16, salt="team-a")
    first = chain(None, tuple(TOKENS[:16]))
    assert block_hashes(TOKENS, 16)[0] == first == hash((ROOT, tuple(TOKENS[:16])))  # the unsalted chain as before
    assert block_hashes(TOKENS, 16, salt="s")[0] == chain(root("s"), tuple(TOKENS[:16]))
    assert root(None) == ROOT != root("s")


def test_a_salted_chain_and_the_probe_are_the_same_under_another_hash_seed():
    """str hashes are salted per process (PYTHONHASHSEED): the salt's root must not be one of them."""
    code = (
        "from tokenweir.common.text.prefix_hash import block_hashes as b, probe;"
        "print(b(list(range(100, 150)), 16, salt='team-a'), probe(16))"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
        chain_text, probe_text = out.stdout.split("]")
        assert chain_text + "]" == str(block_hashes(TOKENS, 16, salt="team-a"))
        assert int(probe_text) == probe(16)


def test_the_probe_covers_the_salts_derivation():
    """An engine that hashes blocks alike but does not salt them shows another probe: no prefix routing to it."""
    assert probe(16) != chain(None, tuple(range(16)))
