"""Packed token bitmasks (int32 words, bit j of word w allows token 32 * w + j, as llguidance and xgrammar fill them)
applied to a batch's logits: forbidden tokens set to -inf in place, on the CPU with numpy or on the logits' device."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def apply_token_bitmask(logits: torch.Tensor, masks: torch.Tensor, rows: Sequence[int] | None = None) -> None:
    """Set logits[rows[i], t] = -inf wherever masks[i] forbids token t, in place.

    logits: float [R, V] on any device; masks: int32 [n, W] from fill_masks (CPU); rows: which logits row each mask
    row constrains (default: row i, n == R), so unconstrained sequences in the batch stay untouched. Tokens past
    32 * W (a model vocab wider than the mask) are forbidden.
    """
    assert logits.dim() == 2 and masks.dim() == 2 and masks.dtype == torch.int32
    n, vocab = masks.shape[0], logits.shape[1]
    rows = list(range(n)) if rows is None else list(rows)
    assert len(rows) == n and (rows == [] or max(rows) < logits.shape[0])
    if n == 0:
        return
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float16, torch.float64):
        # numpy in place, one thread: torch's masked_fill_ wakes its OpenMP pool, which costs ms on a busy CPU.
        values, forbidden = logits.detach().numpy(), _forbidden_bits(masks, vocab)
        if rows == list(range(logits.shape[0])):
            np.copyto(values, -np.inf, where=forbidden)
        else:
            for i, r in enumerate(rows):
                np.copyto(values[r], -np.inf, where=forbidden[i])
        return
    forbidden_t = _forbidden(masks, vocab, logits.device)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(forbidden_t, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden_t, float("-inf"))


def unpack_masks(masks: torch.Tensor, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool [n, vocab_size]: True where the packed int32 masks allow the token (False past the mask's width)."""
    return ~_forbidden(masks, vocab_size, torch.device(device))


def _forbidden_bits(masks: torch.Tensor, vocab_size: int) -> np.ndarray:
    """Bool [n, vocab_size] array, True where forbidden. numpy unpacks the inverted words in one pass (~10 us for a
    49152-token row) and its 0/1 bytes are viewed as bool without a copy."""
    n, words = masks.shape
    width = min(vocab_size, words * 32)
    bits = np.unpackbits(np.invert(masks.numpy()).view(np.uint8), axis=1, bitorder="little")[:, :width].view(bool)
    if width < vocab_size:
        bits = np.concatenate([bits, np.ones((n, vocab_size - width), dtype=bool)], axis=1)
    return bits


def _forbidden(masks: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Bool [n, vocab_size] tensor on `device`, True where forbidden (what masked_fill_ takes)."""
    if device.type == "cpu":
        return torch.from_numpy(_forbidden_bits(masks, vocab_size))
    return _forbidden_on_device(masks, vocab_size, device)


def _forbidden_on_device(masks: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """The same with torch ops on the logits' device (CUDA): one small copy of packed words, unpacked there."""
    n, words = masks.shape
    width = min(vocab_size, words * 32)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    packed = masks.to(device, non_blocking=True)
    forbidden = ((packed.unsqueeze(-1) >> shifts) & 1).view(n, words * 32)[:, :width] == 0
    if width < vocab_size:
        forbidden = torch.cat([forbidden, forbidden.new_ones(n, vocab_size - width)], dim=1)
    return forbidden
