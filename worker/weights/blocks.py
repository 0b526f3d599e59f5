"""A GGUF file's own blocks as the CPU worker's weights (`WORKER_QUANT=gguf`, the default for such a file). Files of
other block types are taken to these two, or to Q5_1 (5-bit codes), first (worker/weights/transcode.py).

The default model ships as a GGUF file whose decoder projections are Q4_1 blocks (32 weights of a row: 4-bit
codes, a float16 scale and minimum) and whose embedding, tied to the lm_head, is Q8_0 (8-bit codes, a scale).
transformers dequantises them to float on load; the int8 path (worker/weights/quant.py) then quantises those floats
again, to 8 bits per weight. Here each projection keeps the file's codes, packed for worker/weights/blocks.cpp, which
multiplies them by each token's activations quantised to 8 bits per block of 32: 5 bits read per layer weight
instead of 8, and the file's weights exactly, so no rotation is needed (each activation block has its own
scale). Every product takes each token alone (blocks.cpp), so a request's tokens do not depend on its batch.

Packing: the rows of 16 output channels form a tile; a tile's block is its codes with channel c's four
consecutive inputs in 32-bit lane c (for Q4_1 a byte holds input i in its low half and input i + 16 in its
high half, as the file's bytes do; Q5_1's fifth bits follow them, `_fifth_bits`), then the 16 scales (and minima)
as float16.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from torch import nn
from transformers import Cache, LlamaForCausalLM, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from worker.weights import native, transcode
from worker.weights.quant import ROWWISE_ATTENTION, RowwiseLlamaLayer, attending, plain_llama
from worker.weights.ragged import attend_layers

Q4_1, Q5_1, Q8_0 = transcode.Q4_1, transcode.Q5_1, transcode.Q8_0
# Bytes of a GGUF block before its codes: the float16 scale, (but for Q8_0) minimum, and Q5_1's 32 fifth bits.
HEADS = {Q4_1: 4, Q5_1: 8, Q8_0: 2}
TILE = 16  # output channels per tile: one 512-bit vector of 32-bit sums


class BlockError(ValueError):
    """The model's weights cannot be taken from its GGUF file's blocks (another type, or other values)."""


@dataclass
class FileTensor:
    """One tensor of a GGUF file: its name, block type, shape (the file's order: a row's inputs first) and its
    bytes, [rows, bytes a row], a view of the file."""

    name: str
    kind: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF's value types
_STRING, _ARRAY = 8, 9


def read_tensors(path: str) -> dict[str, FileTensor]:
    """The tensors of the GGUF file at `path`, skipping its metadata (gguf.GGUFReader parses every field of it,
    the tokenizer's 49,152 strings included, which took longer than all the rest of the packing)."""
    with open(path, "rb") as file:
        view = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    magic, _version, count, fields = struct.unpack_from("<4sIQQ", view, 0)
    if magic != b"GGUF":
        raise BlockError(f"{os.path.basename(path)} is not a GGUF file")
    at, alignment = 24, 32

    def string(at: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", view, at)
        return view[at + 8:at + 8 + length].decode(), at + 8 + length

    def skip(kind: int, at: int) -> int:
        if kind == _STRING:
            return at + 8 + struct.unpack_from("<Q", view, at)[0]
        if kind == _ARRAY:
            item, n = struct.unpack_from("<IQ", view, at)
            at += 12
            if item in _SCALAR_BYTES:
                return at + n * _SCALAR_BYTES[item]
            for _ in range(n):
                at = skip(item, at)
            return at
        return at + _SCALAR_BYTES[kind]

    for _ in range(fields):
        key, at = string(at)
        (kind,) = struct.unpack_from("<I", view, at)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", view, at + 4)
        at = skip(kind, at + 4)
    infos = []
    for _ in range(count):
        name, at = string(at)
        (dims,) = struct.unpack_from("<I", view, at)
        shape = struct.unpack_from(f"<{dims}Q", view, at + 4)
        kind, offset = struct.unpack_from("<IQ", view, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        infos.append((name, gguf.GGMLQuantizationType(kind), shape, offset))
    start = -(-at // alignment) * alignment
    tensors = {}
    for name, kind, shape, offset in infos:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        row_bytes, rows = shape[0] // block * size, int(np.prod(shape[1:], dtype=np.int64))
        data = np.frombuffer(view, np.uint8, rows * row_bytes, start + offset).reshape(rows, row_bytes)
        tensors[name] = FileTensor(name, kind, tuple(shape), data)
    return tensors


def pack(blocks: np.ndarray, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    """A matrix's rows of GGUF blocks ([n, bytes], uint8) packed for blocks.cpp: [tiles, blocks, tile bytes]."""
    per_block = gguf.GGML_QUANT_SIZES[kind][1]
    n = blocks.shape[0]
    tiles = -(-n // TILE)
    rows = blocks.reshape(n, -1, per_block)
    if n % TILE:  # padded with zeros (a copy only then: an output layer is a large share of the load's peak)
        rows = np.concatenate([rows, np.zeros((tiles * TILE - n, *rows.shape[1:]), np.uint8)])
    by_tile = rows.reshape(tiles, TILE, -1, per_block).transpose(0, 2, 1, 3)  # [tiles, blocks, channel, bytes]
    codes = by_tile[..., HEADS[kind]:]
    steps = codes.shape[-1] // 4
    lanes = codes.reshape(*codes.shape[:-1], steps, 4).swapaxes(-2, -3)  # [tiles, blocks, step, channel, 4]
    parts = [lanes.reshape(tiles, -1, steps * TILE * 4)]
    if kind == Q5_1:
        parts.append(_fifth_bits(by_tile[..., 4:8]).reshape(tiles, -1, TILE * 4))
    scales = [by_tile[..., i:i + 2] for i in range(0, 2 if kind == Q8_0 else 4, 2)]  # each [tiles, blocks, channel, 2]
    parts += [s.reshape(tiles, -1, 2 * TILE) for s in scales]
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)))


# Where blocks.cpp wants a Q5_1 code's fifth bit: byte t of a channel's four, for step j (inputs 4 j + t and
# 16 + 4 j + t), bit 4 + j for the first and bit j for the second.
_STEP, _BYTE = np.arange(4).reshape(4, 1), np.arange(4).reshape(1, 4)
_FIRST, _SECOND = (4 * _STEP + _BYTE).astype(np.uint32), (16 + 4 * _STEP + _BYTE).astype(np.uint32)


def _fifth_bits(words: np.ndarray) -> np.ndarray:
    """GGUF's Q5_1 fifth bits ([..., 4] bytes: bit i of the word, weight i) as blocks.cpp's bytes ([..., 4])."""
    word = np.ascontiguousarray(words).view("<u4").astype(np.uint32)[..., None]  # [..., 1, 1]
    first = ((word >> _FIRST) & 1) << (4 + _STEP)
    second = ((word >> _SECOND) & 1) << _STEP
    return (first | second).sum(axis=-2).astype(np.uint8)  # the bits differ: the sum is their or


class BlockLinear(nn.Module):
    """A linear layer (no bias) over packed GGUF blocks, float32 in and out, through blocks.cpp."""

    def __init__(self, tensors: list[FileTensor], rows: list[np.ndarray | None] | None = None) -> None:
        """`tensors`' rows, each tensor's reordered by its entry of `rows` where that is not None (llama.cpp's q
        and k differ from transformers'), one matrix after another (q, k, v fused: one call)."""
        super().__init__()
        kinds = [t.kind for t in tensors]
        unknown = sorted({k.name for k in kinds if k not in transcode.READABLE})
        if unknown:
            raise BlockError(f"{', '.join(t.name for t in tensors)}: blocks of {', '.join(unknown)}, which the "
                             "kernels cannot take")
        self.kind = transcode.target(kinds)
        self.exact = transcode.exact(kinds)  # the file's own weights, bit for bit
        orders = rows or [None] * len(tensors)
        parts = [transcode.transcode(t.data if o is None else t.data[o], t.kind, self.kind)
                 for t, o in zip(tensors, orders, strict=True)]
        raw = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.in_features = int(tensors[0].shape[0])
        self.out_features = raw.shape[0]
        self.packed = pack(raw, self.kind)

    def dequantized(self) -> torch.Tensor:
        """The float weights the packed blocks hold ([out, in]), by gguf's arithmetic (d q + m, or d q, in
        float32): the values transformers loads from the file, bit for bit, where the packing is right."""
        tiles, blocks, _ = self.packed.shape
        steps = 8 if self.kind == Q8_0 else 4
        end = steps * TILE * 4 + (TILE * 4 if self.kind == Q5_1 else 0)
        codes = self.packed[..., :steps * TILE * 4].reshape(tiles, blocks, steps, TILE, 4).permute(0, 3, 1, 2, 4)
        halves = self.packed[..., end:].contiguous().view(torch.float16).float()  # [tiles, blocks, 16k]
        scale = halves[..., :TILE].permute(0, 2, 1).unsqueeze(-1)  # [tiles, channel, blocks, 1]
        if self.kind != Q8_0:
            flat = codes.reshape(tiles, TILE, blocks, 16)
            q = torch.cat([flat & 15, flat >> 4], dim=-1)
            if self.kind == Q5_1:
                fifth = self.packed[..., end - TILE * 4:end].reshape(tiles, blocks, TILE, 1, 4).permute(0, 2, 1, 3, 4)
                shifts = torch.tensor([4, 5, 6, 7, 0, 1, 2, 3]).view(8, 1)  # the first inputs' steps, the second's
                bits = (fifth.long() >> shifts) & 1  # [tiles, channel, blocks, 8, 4]: input 4 * (row) + t
                q = q | (bits.reshape(tiles, TILE, blocks, 32) << 4)
            weights = scale * q.float() + halves[..., TILE:].permute(0, 2, 1).unsqueeze(-1)
        else:
            weights = codes.reshape(tiles, TILE, blocks, 32).view(torch.int8).float() * scale
        return weights.reshape(tiles * TILE, -1)[:self.out_features]

    def forward(self, x: torch.Tensor, gain: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
        """x [..., in] (RMSNorm'd with `gain` first, when given) times the weights."""
        return native.ops.block_linear(x, self.packed, self.out_features, gain, eps)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, blocks={self.kind.name}"


class BlockLlamaLayer(RowwiseLlamaLayer):
    """A Llama decoder layer over its GGUF blocks: RMSNorm (with its gain) and the fused q, k, v product in one
    call, worker/weights/native.cpp's heads and attention, then o_proj, the MLP and both residuals in one call."""

    def __init__(self, layer: LlamaDecoderLayer, qkv: BlockLinear, o_proj: BlockLinear, gate_up: BlockLinear,
                 down_proj: BlockLinear) -> None:
        super().__init__(layer, native=True)
        self.qkv, self.o_proj, self.gate_up, self.down_proj = qkv, o_proj, gate_up, down_proj
        self.stack: BlockStack | None = None  # every layer of its model, once quantize_blocks has them all
        self.gains = (self.input_layernorm.weight.detach().float().contiguous(),
                      self.post_attention_layernorm.weight.detach().float().contiguous())
        attn = layer.self_attn
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        self.qkv_bias = None if biases[0] is None else torch.cat([b.detach().float() for b in biases]).contiguous()

    def forward_parts(self, hidden: list[torch.Tensor], rope: list[tuple[torch.Tensor, torch.Tensor]],
                      masks: list[torch.Tensor | None], caches: list[Cache]) -> list[torch.Tensor]:
        """One part over a ragged cache (a decode step, or a prefill alone): the whole layer in one compiled call,
        the same kernels in the same order as the general path, without a dozen calls from Python per layer."""
        cache = caches[0].layers[self.layer_idx] if len(hidden) == 1 and caches[0] is not None else None
        if cache is None or not attending(cache):
            return super().forward_parts(hidden, rope, masks, caches)
        x, (cos, signed_sin) = hidden[0], rope[0]
        rows, length = x.shape[:2]
        qkv, o_proj, gate_up, down_proj = self.qkv, self.o_proj, self.gate_up, self.down_proj

        def layer(keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
            return native.ops.block_layer(x, qkv.packed, qkv.out_features, self.qkv_bias, self.head_norms,
                                          self.gains[0], o_proj.packed, gate_up.packed, down_proj.packed,
                                          down_proj.in_features, self.gains[1], self.norm_eps, self.head_dim,
                                          self.q_heads, self.kv_heads, cos, signed_sin, keys, values, lengths,
                                          self.scaling)

        return [cache.attend_with(x.new_empty(()).expand(rows, self.kv_heads, length, self.head_dim), layer)]

    @staticmethod
    def forward_stack(layers: Sequence[RowwiseLlamaLayer], hidden: list[torch.Tensor],
                      rope: list[tuple[torch.Tensor, torch.Tensor]], masks: list[torch.Tensor | None],
                      caches: list[Cache]) -> list[torch.Tensor]:
        """One part over a ragged cache: every layer in one compiled call (`BlockStack`), not 30 from Python."""
        stack = layers[0].stack
        cache = caches[0] if len(hidden) == 1 else None
        if stack is None or cache is None or not attending(cache.layers[0]):
            return RowwiseLlamaLayer.forward_stack(layers, hidden, rope, masks, caches)
        return [stack.forward(hidden[0], rope[0], cache)]

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        # The kernel itself: a module call's hooks cost more than nothing 30 times a step.
        projected = native.ops.block_linear(x, self.qkv.packed, self.qkv.out_features, self.gains[0], self.norm_eps)
        return projected if self.qkv_bias is None else projected.add_(self.qkv_bias)

    def mlp_residual(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        return native.ops.block_mlp_residual(x, attended, self.o_proj.packed, self.gate_up.packed,
                                             self.down_proj.packed, self.down_proj.in_features, self.gains[1],
                                             self.norm_eps)


class BlockStack:
    """A model's `BlockLlamaLayer`s side by side, for blocks.cpp's block_layers: each weight's list over the
    layers, gathered once."""

    def __init__(self, layers: list[BlockLlamaLayer]) -> None:
        first = layers[0]
        self.first = first
        self.qkv = [layer.qkv.packed for layer in layers]
        self.qkv_biases = [layer.qkv_bias for layer in layers if layer.qkv_bias is not None]
        self.head_norms = [gain for layer in layers for gain in layer.head_norms]
        self.input_gains = [layer.gains[0] for layer in layers]
        self.o_proj = [layer.o_proj.packed for layer in layers]
        self.gate_up = [layer.gate_up.packed for layer in layers]
        self.down_proj = [layer.down_proj.packed for layer in layers]
        self.post_gains = [layer.gains[1] for layer in layers]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: Cache) -> torch.Tensor:
        """x [rows, length, width] through every layer over the ragged `cache`: the same calls as the layers'
        own block_layer one by one, so the same bits."""
        first, (cos, signed_sin) = self.first, rope
        rows, length = x.shape[:2]

        def layers(keys: list[torch.Tensor], values: list[torch.Tensor], lengths: list[int]) -> torch.Tensor:
            return native.ops.block_layers(x, self.qkv, first.qkv.out_features, self.qkv_biases, self.head_norms,
                                           self.input_gains, self.o_proj,
                                           self.gate_up, self.down_proj, first.down_proj.in_features,
                                           self.post_gains, first.norm_eps, first.head_dim, first.q_heads,
                                           first.kv_heads, cos, signed_sin, keys, values, lengths, first.scaling)

        shape = x.new_empty(()).expand(rows, first.kv_heads, length, first.head_dim)
        return attend_layers(cache.layers, shape, layers)


def agreeing_level(level: int) -> int:
    """The blocks' kernels at `level` (native.cap's), lowered until their products give the plain loops' bits on a
    small matrix of each block type, as by design they do on every instruction set; returns the level kept. A
    kernel that no CPU of this kind has checked then serves through a slower one, never as wrong tokens."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((13, 64)).astype(np.float32))  # row groups of 8, 4 and 1
    layers = []
    for kind in (Q4_1, Q5_1, Q8_0):
        scales = (rng.standard_normal((40, 2, HEADS[kind] // 2)) * 0.01).astype(np.float16).view(np.uint8)
        if kind == Q5_1:
            scales[..., 4:] = rng.integers(0, 256, (40, 2, 4), dtype=np.uint8)  # the fifth bits
        codes = rng.integers(0, 256, (40, 2, gguf.GGML_QUANT_SIZES[kind][1] - HEADS[kind]), dtype=np.uint8)
        layers.append(BlockLinear([FileTensor("check", kind, (64, 40), np.concatenate([scales, codes], -1)
                                              .reshape(40, -1))]))
    native.ops.block_isa(0)
    plain = [layer(x) for layer in layers]
    for kept in range(level, 0, -1):
        native.ops.block_isa(kept)
        if all(torch.equal(layer(x), want) for layer, want in zip(layers, plain, strict=True)):
            return kept
    return int(native.ops.block_isa(0))


def holds(block: BlockLinear, expected: torch.Tensor) -> bool:
    """Whether `block` holds the weights `expected` ([out, in]): bit for bit where it took the file's blocks as
    they are; within what transcoding rounds otherwise (worker/weights/transcode.py: half an 8-bit step of a
    block's largest weight, or a float16 scale's last bit), per row, which a row or block taken from the wrong
    place far exceeds."""
    weights = block.dequantized()
    if block.exact:
        return torch.equal(weights, expected)
    bound = expected.abs().amax(dim=1, keepdim=True) * transcode.TOLERANCE + 1e-12
    return bool(((weights - expected).abs() <= bound).all())


def _llama_rows(n: int, heads: int) -> np.ndarray:
    """Which of llama.cpp's q (or k) rows each of transformers' rows is: the file interleaves each head's two
    rotary halves, and transformers' GGUF loader undoes that on load (the same reshape, on row numbers)."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(2, 1).reshape(n)


def quantize_blocks(model: PreTrainedModel, path: str, tensors: dict[str, FileTensor] | None = None) -> int:
    """Replace a Llama-shaped model's decoder layers by `BlockLlamaLayer`s and its lm_head by a `BlockLinear`, over
    the GGUF file at `path`'s blocks (`tensors`, where they are read already), in place; returns how many
    matrices. Each matrix's blocks must hold the very weights the model was loaded with (checked, so that a file
    and a model that differ fail here, with BlockError, and nothing is replaced), unless the model was made
    without them (on the meta device: worker/weights/from_file.py)."""
    if not plain_llama(model) or model.dtype != torch.float32:
        raise BlockError("GGUF blocks serve a float32 Llama-shaped model only (Llama, Mistral, Qwen 2 and 3)")
    tensors = tensors if tensors is not None else read_tensors(path)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    interleaved = isinstance(model, LlamaForCausalLM)

    def linear(names: list[str], modules: list[nn.Linear], rows: list[np.ndarray | None] | None = None) -> BlockLinear:
        missing = [name for name in names if name not in tensors]
        if missing:
            raise BlockError(f"{os.path.basename(path)} has no {', '.join(missing)}")
        block = BlockLinear([tensors[name] for name in names], rows)
        rows_wanted = sum(m.out_features for m in modules)
        if block.out_features != rows_wanted:
            raise BlockError(f"{', '.join(names)} have {block.out_features} rows where the model has {rows_wanted}")
        if not modules[0].weight.is_meta and not holds(block, torch.cat([m.weight.detach() for m in modules])):
            raise BlockError(f"{', '.join(names)} do not hold the model's weights")
        return block

    layers = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp, blk = layer.self_attn, layer.mlp, f"blk.{i}."
        # llama.cpp's converter interleaves a Llama's q and k rows (not Qwen's, whose rotation is NeoX's)
        rows = ([_llama_rows(attn.q_proj.out_features, heads), _llama_rows(attn.k_proj.out_features, kv_heads), None]
                if interleaved else None)
        qkv = linear([blk + "attn_q.weight", blk + "attn_k.weight", blk + "attn_v.weight"],
                     [attn.q_proj, attn.k_proj, attn.v_proj], rows)
        layers.append(BlockLlamaLayer(layer, qkv, linear([blk + "attn_output.weight"], [attn.o_proj]),
                                      linear([blk + "ffn_gate.weight", blk + "ffn_up.weight"],
                                             [mlp.gate_proj, mlp.up_proj]),
                                      linear([blk + "ffn_down.weight"], [mlp.down_proj])))
    head = "output.weight" if "output.weight" in tensors else "token_embd.weight"
    lm_head = linear([head], [model.lm_head])
    stack = BlockStack(layers)
    for i, layer in enumerate(layers):
        layer.stack = stack  # not a module: the layers' own tensors, listed
        model.model.layers[i] = layer
    model.lm_head = lm_head
    model.set_attn_implementation(ROWWISE_ATTENTION)
    return 7 * len(layers) + 1
