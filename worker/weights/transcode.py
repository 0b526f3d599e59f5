"""Any GGUF matrix as the three block types worker/weights/blocks.cpp multiplies: Q4_1, Q5_1 and Q8_0 (32 weights a
block).

Files users download mix types: a Q4_K_M file is Q4_K with Q6_K for some layers' v and down projections (and Q5_0
or Q8_0 where a row's length is not a multiple of 256, as in SmolLM2's 576), a Q5_K_M file Q5_K with Q6_K. Each
fused matrix (q, k and v; gate and up) is taken to one type:

- Q4_1 when every part is 4-bit with a scale and an offset per 32 weights: Q4_1 and Q8_0 as they are; Q4_0 (its
  offset is -8 steps, exact); Q4_K, whose 256-weight super-block holds eight such sub-blocks, each with a 6-bit
  scale and minimum times the super-block's: the products are rounded to float16, one part in 2**11 of a scale.
- Q5_1 when every part is 4- or 5-bit so: Q5_0 (offset -16 steps, exact), Q5_1 as it is, Q5_K's sub-blocks as
  Q4_K's, and the 4-bit types above with their fifth bits 0.
- Q8_0 otherwise: every other type (Q6_K, the 2- and 3-bit K-quants, float16, bfloat16, float32) is dequantized by
  gguf's arithmetic and quantized again to 8 bits per 32 weights, an error at most half a step of the block's
  largest weight over 127 (an eighth of a 6-bit step or less).

`exact` says whether the blocks hold the file's very weights (the loader compares them bit for bit then, and
within a tolerance otherwise).
"""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import numpy as np
from gguf import quants

T = gguf.GGMLQuantizationType
Q4_1, Q5_1, Q8_0 = T.Q4_1, T.Q5_1, T.Q8_0
FOUR_BIT = frozenset({T.Q4_0, T.Q4_1, T.Q4_K})
FIVE_BIT = FOUR_BIT | {T.Q5_0, T.Q5_1, T.Q5_K}
# Taken over without rounding anything, to the type of their fused matrix.
EXACT = {Q4_1: frozenset({T.Q4_0, T.Q4_1}), Q5_1: frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}),
         Q8_0: frozenset({T.Q8_0})}
BLOCK = 32
# Every type gguf can dequantize (the kernels take all of them, most as Q8_0); the ternary and 1-bit types are
# left out, as transformers cannot load their files either.
READABLE = frozenset({T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K,
                      T.Q6_K, T.IQ4_NL, T.IQ4_XS})
# Rows dequantized at a time on the way to Q8_0: a whole output layer in float32 (and gguf's temporaries) would be
# several times the file's size at the load's peak; each block's arithmetic is its own, so the bits are the same.
CHUNK_ROWS = 1024
# What transcoding may move a weight by, as a share of its row's largest: half an 8-bit step of a block's largest
# (1/254) plus a float16 scale's rounding (2**-11 of a block's largest), with room to spare.
TOLERANCE = 1 / 128


def target(kinds: Sequence[T]) -> T:
    """The one block type a fused matrix of these parts is packed as."""
    if all(kind in FOUR_BIT for kind in kinds):
        return Q4_1
    return Q5_1 if all(kind in FIVE_BIT for kind in kinds) else Q8_0


def exact(kinds: Sequence[T]) -> bool:
    """Whether `transcode` keeps every weight of these parts bit for bit (their target's arithmetic is theirs)."""
    return all(kind in EXACT[target(kinds)] for kind in kinds)


def transcode(rows: np.ndarray, kind: T, goal: T) -> np.ndarray:
    """A matrix's rows of `kind` blocks ([n, bytes a row], uint8, or the float values for F32/F16/BF16 as bytes)
    as rows of `goal` blocks (Q4_1, Q5_1 or Q8_0, GGUF's byte layout)."""
    if kind == goal:
        return rows
    if goal == Q4_1 and kind == T.Q4_0:
        return _q4_0_as_q4_1(rows)
    if goal == Q4_1 and kind == T.Q4_K:
        return _q4_k_as_q4_1(rows)
    if goal == Q5_1 and kind in FOUR_BIT:
        return _q4_1_as_q5_1(transcode(rows, kind, Q4_1))
    if goal == Q5_1 and kind == T.Q5_0:
        return _q5_0_as_q5_1(rows)
    if goal == Q5_1 and kind == T.Q5_K:
        return _q5_k_as_q5_1(rows)
    if goal != Q8_0:
        raise ValueError(f"{kind.name} blocks cannot be taken to {goal.name}")
    out = None
    for start in range(0, rows.shape[0], CHUNK_ROWS):
        values = quants.dequantize(rows[start:start + CHUNK_ROWS], kind)  # [rows, inputs] float32
        chunk = quants.quantize(np.ascontiguousarray(values, np.float32), Q8_0)
        if out is None:
            out = np.empty((rows.shape[0], chunk.shape[1]), np.uint8)
        out[start:start + len(chunk)] = chunk
    return out


def _q4_0_as_q4_1(rows: np.ndarray) -> np.ndarray:
    """Q4_0's w = d (c - 8) is Q4_1's w = d c + m with m = -8 d (a power of two: exact in float16)."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 18)
    scale = blocks[..., :2].view(np.float16)
    minimum = (scale.astype(np.float32) * -8).astype(np.float16)
    out = np.concatenate([blocks[..., :2], minimum.view(np.uint8), blocks[..., 2:]], axis=-1)
    return out.reshape(n, -1)


def _k_sub_blocks(blocks: np.ndarray, codes_at: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_K or Q5_K super-block's ([super-blocks, bytes]) eight sub-blocks: scales d * sc and minima -dmin * m
    rounded to float16 ([super-blocks, 8] each), and the low four bits of their codes ([super-blocks, 8, 32]),
    which lie in 4 chunks of 32 bytes from `codes_at`: chunk c's low halves sub-block 2c, its high halves 2c + 1."""
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    sc, m = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32)).astype(np.float16)
    minimum = (-dmin * m.astype(np.float32)).astype(np.float16)
    qs = blocks[:, codes_at:codes_at + 128].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return scale, minimum, (qs & 15).reshape(-1, 8, BLOCK)


def _q4_k_as_q4_1(rows: np.ndarray) -> np.ndarray:
    """Each of a Q4_K super-block's eight sub-blocks as one Q4_1 block: scale d * sc, minimum -dmin * m (rounded
    to float16), its 32 codes packed as Q4_1 packs them (byte i: code i low, code i + 16 high)."""
    n = rows.shape[0]
    scale, minimum, codes = _k_sub_blocks(rows.reshape(-1, 144), 16)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scale[..., None].view(np.uint8), minimum[..., None].view(np.uint8), packed], axis=-1)
    return out.reshape(n, -1)


def _q4_1_as_q5_1(rows: np.ndarray) -> np.ndarray:
    """Q4_1 blocks as Q5_1's with every fifth bit 0: the same weights."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 20)
    fifth = np.zeros((*blocks.shape[:2], 4), np.uint8)
    return np.concatenate([blocks[..., :4], fifth, blocks[..., 4:]], axis=-1).reshape(n, -1)


def _q5_0_as_q5_1(rows: np.ndarray) -> np.ndarray:
    """Q5_0's w = d (c - 16) is Q5_1's w = d c + m with m = -16 d (a power of two: exact in float16)."""
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, 22)
    minimum = (blocks[..., :2].view(np.float16).astype(np.float32) * -16).astype(np.float16)
    return np.concatenate([blocks[..., :2], minimum.view(np.uint8), blocks[..., 2:]], axis=-1).reshape(n, -1)


def _q5_k_as_q5_1(rows: np.ndarray) -> np.ndarray:
    """Each of a Q5_K super-block's eight sub-blocks as one Q5_1 block: its scale and minimum as Q4_K's, its low
    four bits as Q4_K's codes, its fifth bits bit s (the sub-block) of the super-block's 32 high-bit bytes."""
    n = rows.shape[0]
    blocks = rows.reshape(-1, 176)
    scale, minimum, low = _k_sub_blocks(blocks, 48)
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1  # [super-blocks, 8, 32]
    packed = low[..., :16] | (low[..., 16:] << 4)
    fifth = np.packbits(high, axis=-1, bitorder="little")  # bit i of the 32-bit word: weight i
    out = np.concatenate([scale[..., None].view(np.uint8), minimum[..., None].view(np.uint8), fifth, packed], axis=-1)
    return out.reshape(n, -1)
