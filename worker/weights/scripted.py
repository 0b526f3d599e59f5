"""The int8 Llama layer's arithmetic (worker/weights/quant.py), run by TorchScript's interpreter instead of Python's.

A decode step at batch 1 makes some 500 small tensor calls (30 layers of four int8 products, norms, rotary
embedding, attention and the MLP), and each paid a few microseconds of Python around a kernel of a few
microseconds. Scripted, the very same ATen calls run in the same order on the same values, so every result is
eager's, bit for bit (tested against each function's plain Python), and Python is paid once per piece of a
layer instead of once per call. TorchScript fuses nothing on a CPU unless told to, and nothing here tells it.
(torch.compile would generate C++ and need a compiler at run time, which the worker image does not have.)
`PLAIN` keeps each function's Python, for the tests.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

ACT_MAX = 127  # activations: round(x / rowmax * 127) in [-127, 127], fed to fbgemm as uint8 with zero point 128
ACT_ZERO_POINT = 128
EPS = 1e-12  # floor of a scale: an all-zero row or channel quantises to zeros instead of NaN
Packed = torch.classes.quantized.LinearPackedParamsBase  # fbgemm's packed int8 weights


def int8_linear(x: Tensor, packed: Packed, bias: Tensor | None, norm_eps: float | None,
                act_scale: float = 1.0 / ACT_MAX, zero_point: int = ACT_ZERO_POINT, floor: float = EPS) -> Tensor:
    """x W^T (+ bias) with x quantised per row. x / rowmax is in [-1, 1]; the kernel quantises it with scale
    1/127 (elementwise rounding), multiplies in integers and scales each output by (1/127) * channel scale;
    * rowmax restores it. (A script cannot read the module's numbers: they come in as defaults.) With
    `norm_eps`, of RMSNorm(x) of gain 1: the norm only scales each row, which the row's own quantisation
    scale undoes, so it becomes one more factor of the output's scale."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.float()
    rowmax = x.abs().amax(dim=-1, keepdim=True).clamp_min_(floor)  # 3x faster than vector_norm(inf) at batch 16
    out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x / rowmax, act_scale, zero_point, packed)
    if norm_eps is not None:
        rowmax = rowmax * x.pow(2).mean(dim=-1, keepdim=True).add_(norm_eps).rsqrt_()
    out = out.mul_(rowmax) if bias is None else out.mul_(rowmax).add_(bias)
    return out if dtype == torch.float32 else out.to(dtype)


def normed_linear(x: Tensor, packed: Packed, gain: Tensor | None, eps: float, bias: Tensor | None = None) -> Tensor:
    """The int8 product of RMSNorm(x) (+ bias): folded into the call when the gain is 1 (`gain` None: a rotated
    model's, worker/weights/rotation.py), else as transformers' LlamaRMSNorm computes it."""
    if gain is None:
        return int8_linear(x, packed, bias, eps)
    dtype = x.dtype
    wide = x.to(torch.float32)
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return int8_linear(gain * normed.to(dtype), packed, bias, None)


def heads(qkv: Tensor, rows: int, length: int, head_dim: int, q_heads: int, kv_heads: int, cos: Tensor,
          signed_sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value heads ([rows, heads, length, head_dim]) of a part's fused projections, the query
    and key heads rotated in one go. Llama's rotation is x * cos + cat(-x2, x1) * sin over a head's halves;
    with the minus on sin's first half (`signed_sin`, worker/weights/quant.py's rotary_factors) it is one roll."""
    split = qkv.view(rows, length, -1, head_dim).transpose(1, 2)
    qk = split[:, :q_heads + kv_heads]
    qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * signed_sin
    return qk[:, :q_heads], qk[:, q_heads:], split[:, q_heads + kv_heads:]


def attend(query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, first_row: int, n: int,
           scaling: float | None) -> Tensor:
    """Attention of rows that each hold `n` real tokens (the last `n` of `key`), over those tokens only;
    zeros for padding queries."""
    q_len, kv_len = query.shape[2], key.shape[2]
    t = min(q_len, n)  # the rows' real queries: the last t
    # t == n: a prefill (causal); t == 1: a decode step (sees all n keys); else a chunk after cached
    # tokens, which needs the mask's real part (its last n columns).
    mask: Tensor | None = None
    if t != 1 and t != n:
        assert attention_mask is not None
        mask = attention_mask[first_row:first_row + query.shape[0], :, q_len - t:, attention_mask.shape[-1] - n:]
    if kv_len != n:
        key, value = key[:, :, kv_len - n:], value[:, :, kv_len - n:]
    out = torch.nn.functional.scaled_dot_product_attention(
        query if t == q_len else query[:, :, q_len - t:], key, value, attn_mask=mask,
        is_causal=t > 1 and mask is None, scale=scaling, enable_gqa=True)
    return out if t == q_len else torch.nn.functional.pad(out, [0, 0, q_len - t, 0])


def attend_rows(query: Tensor, keys: list[Tensor], values: list[Tensor], attention_mask: Tensor | None,
                scaling: float | None) -> Tensor:
    """Each row over its own keys and values (a ragged cache's: [1, heads, n, dim] each), one call per row;
    [rows, length, heads, dim]."""
    runs = [attend(query[row:row + 1], keys[row], values[row], attention_mask, row, keys[row].shape[2], scaling)
            for row in range(query.shape[0])]
    return (runs[0] if len(runs) == 1 else torch.cat(runs)).transpose(1, 2).contiguous()


def write_rows(key_buffers: list[Tensor], value_buffers: list[Tensor], lengths: list[int], keys: Tensor,
               values: Tensor) -> tuple[list[Tensor], list[Tensor]]:
    """Row r's new keys and values written after its lengths[r] tokens into its own buffers (which have room);
    returns each row's keys and values so far, views of its buffers. (A copy per row: a script drops one
    _foreach_copy_ into such views as dead code.)"""
    added = keys.shape[2]
    row_keys, row_values = [], []
    for r in range(len(lengths)):
        key_buffers[r].narrow(2, lengths[r], added).copy_(keys[r:r + 1])
        value_buffers[r].narrow(2, lengths[r], added).copy_(values[r:r + 1])
        row_keys.append(key_buffers[r].narrow(2, 0, lengths[r] + added))
        row_values.append(value_buffers[r].narrow(2, 0, lengths[r] + added))
    return row_keys, row_values


def mlp_residual(x: Tensor, attended: Tensor, o_proj: Packed, gate_up: Packed, down_proj: Packed,
                 gain: Tensor | None, eps: float, rotation: Tensor | None) -> Tensor:
    """The rest of a layer after attention: its output projection and residual, then the MLP and its residual.
    With `rotation` (a Hadamard block, worker/weights/rotation.py) down_proj's input is rotated first."""
    x = x + int8_linear(attended, o_proj, None, None)
    gate, up = normed_linear(x, gate_up, gain, eps).chunk(2, dim=-1)
    mixed = torch.nn.functional.silu(gate) * up
    if rotation is not None:
        mixed = rotate_blocks(mixed, rotation)
    return x + int8_linear(mixed, down_proj, None, None)


def rotate_blocks(x: Tensor, block: Tensor) -> Tensor:
    """x times the block-diagonal matrix with `block` on its diagonal: one product of the same shape per row
    (bmm), not one over the whole batch (matmul), whose kernel varies with the number of rows and with it
    the last bits: a row's result must not depend on its batch."""
    size = block.shape[0]
    blocks = x.reshape(-1, x.shape[-1] // size, size)
    return torch.bmm(blocks, block.expand(blocks.shape[0], -1, -1)).reshape(x.shape)


PLAIN = {f.__name__: f for f in (int8_linear, normed_linear, heads, attend, attend_rows, write_rows,
                                  rotate_blocks, mlp_residual)}
with warnings.catch_warnings():
    # Deprecated in favour of torch.compile, whose CPU code needs a C++ compiler at run time; torch is pinned.
    warnings.filterwarnings("ignore", message=".*torch.jit.script.* is deprecated", category=DeprecationWarning)
    # In dependency order: a script finds the functions it calls by name in this module's globals.
    int8_linear = torch.jit.script(int8_linear)
    normed_linear = torch.jit.script(normed_linear)
    heads = torch.jit.script(heads)
    attend = torch.jit.script(attend)
    attend_rows = torch.jit.script(attend_rows)
    write_rows = torch.jit.script(write_rows)
    rotate_blocks = torch.jit.script(rotate_blocks)
    mlp_residual = torch.jit.script(mlp_residual)
