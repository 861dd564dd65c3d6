"""What the gateway's `serve` and the engine's command line agree on: the env variables that carry the engine's API
key and the key its KV transfers are signed with, how a size is written ('512MiB'), and the share of GPU memory an
engine takes by default."""

from __future__ import annotations

import argparse
import re

API_KEY_ENV = "TOKENWEIR_ENGINE_API_KEY"  # as vLLM reads VLLM_API_KEY
KV_TRANSFER_KEY_ENV = "TOKENWEIR_KV_TRANSFER_KEY"  # shared by the engines of a disaggregated pool (engine/kv_transfer)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.85  # of the device's memory, shared out between the replicas of `serve --engines N`
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512MiB', '2GiB', '1.5G' (binary units; 'MB' and 'MiB' both mean 2**20 here)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512MiB or 2GiB)")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * 1024 ** " KMGT".index(unit or " "))
