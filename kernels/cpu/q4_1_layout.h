// The packed Q4_1 rows that q4_linear.cpp and q4_prefill.cpp read (engine/model/gguf_blocks.py's pack_q4_1 makes
// them; q4_linear.cpp's top says why this layout): per row of B = K / 32 blocks, [B * 16 nibble bytes][B float16 d]
// [B float16 m], the nibble bytes of every full group of 8 blocks interleaved by 4-byte words.
#pragma once
#include <cstdint>

static constexpr int64_t QK = 32;       // values per block
static constexpr int64_t GROUP = 8;     // blocks per interleaved group
static constexpr int64_t NIBBLES = 16;  // nibble bytes per block
static constexpr int64_t ROW_BYTES_PER_BLOCK = 20;

// Where nibble byte k of block b (values k and k + 16) sits among a row's nibble bytes: inside a full group, byte
// k % 4 of word (k / 4, b % 8) of the group; the trailing B % 8 blocks in the GGUF's order.
static inline int64_t nibble_byte_at(int64_t b, int64_t k, int64_t B) {
  if (b >= B / GROUP * GROUP) return b * NIBBLES + k;
  return (b / GROUP) * GROUP * NIBBLES + ((k / 4) * GROUP + b % GROUP) * 4 + k % 4;
}
