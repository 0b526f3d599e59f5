"""Int8 linear layers for the CPU worker, batch-invariant by construction.

Weights are quantised once, symmetric per output channel; activations dynamically, symmetric per row
(each token its own scale). The product is an integer matrix product, which is exact, and every float
step before and after it is elementwise within a row, so a row's output does not depend on the other
rows of the batch: a request's greedy text cannot change with its batch-mates. (Per-tensor activation
scales, as in `torch.ao.quantization.quantize_dynamic`, would couple the rows through the shared scale.)

The kernel is fbgemm's (`quantized::linear_with_input_q_dq_qweight_dq_output_fp32`): it is the fast
int8 GEMM on AVX2 CPUs, where `torch._int_mm` falls back to a reference loop (about 50x slower than
fp32 on the 2-core development machine). fbgemm multiplies unsigned activations by signed weights
with `vpmaddubsw`, whose pairwise int16 sums saturate for full-range 8-bit operands; weights are
therefore kept to 7 bits ([-63, 63]) so that 255 * 63 * 2 < 2**15 and the accumulation stays exact.

Attention must then be batch-invariant too. SDPA over a left-padded batch rounds in the last bit
differently with the padding width; in fp32 that never changes a greedy token, but int8's rounding of
activations turns such a difference into a whole quantisation step, which grows layer after layer
(19 of 20 greedy answers changed with their batch-mates). So the int8 model runs attention one row at
a time over that row's own tokens: the very kernel call a request makes when it is alone. (A prefill
also rounds differently from the decode steps that produced the same tokens, which is why the engine
replays a migrated request's delivered tokens as decode steps.)
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ACT_MAX = 127  # activations: round(x / rowmax * 127) in [-127, 127], fed to fbgemm as uint8 with zero point 128
ACT_ZERO_POINT = 128
WEIGHT_MAX = 63  # weights: 7 bits, so that fbgemm's int16 pair sums cannot saturate (see above)
EPS = 1e-12  # floor of a scale: an all-zero row or channel quantises to zeros instead of NaN
ROWWISE_ATTENTION = "llmserve_rowwise_sdpa"
_sdpa = nn.functional.scaled_dot_product_attention


def supported() -> bool:
    """fbgemm is in torch's x86 builds; ARM builds lack it."""
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear(nn.Module):
    """Drop-in for an `nn.Linear` on CPU: int8 weights, per-row int8 activations, float in and out."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(EPS) / WEIGHT_MAX
        q = torch.round(weight / scale[:, None]).clamp_(-WEIGHT_MAX, WEIGHT_MAX).to(torch.int8)
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():
            # The packing API takes a qint8 tensor, whose creation functions warn of their future removal;
            # the packed weight is all that is kept (torch is pinned, see the Makefile).
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
            qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), zero_points, 0)
        # No bias in the packed weight: the kernel would add it before the row scale is applied.
        self.packed = torch.ops.quantized.linear_prepack(qweight, None)  # packs for the current engine: fbgemm
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Six ops per call (30 layers x 7 linears per decode step: Python overhead counts at batch 1).
        # x / rowmax is in [-1, 1]; the kernel quantises it with scale 1/127 (elementwise rounding),
        # multiplies in integers and scales each output by (1/127) * channel scale; * rowmax restores it.
        if self.dtype != torch.float32:
            return self._forward(x.float()).to(self.dtype)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        rowmax = x.abs().amax(dim=-1, keepdim=True).clamp_min_(EPS)  # 3x faster than vector_norm(inf) at batch 16
        out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            x / rowmax, 1.0 / ACT_MAX, ACT_ZERO_POINT, self.packed).mul_(rowmax)
        return out if self.bias is None else out.add_(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def rowwise_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None,
                 **kwargs: object) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention one row at a time without its left padding: each row makes the call
    it would make alone (same shapes, no mask), so its result cannot depend on the rest of the batch.
    Assumes left padding (the engine's and `generate`'s), read off the mask's last query row, and a
    decoder in eval mode (causal, no dropout, no softcap)."""
    if kwargs.get("sliding_window") or kwargs.get("softcap") or kwargs.get("position_bias") is not None:
        raise NotImplementedError("int8's row-wise attention handles plain causal attention only")
    batch, q_len, kv_len = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:
        valid = [kv_len] * batch
    else:
        last = attention_mask[:, 0, -1]
        valid = (last if last.dtype == torch.bool else last == 0).sum(dim=-1).tolist()
    rows = []
    for b, (q, k, v) in enumerate(zip(query.split(1), key.split(1), value.split(1), strict=True)):
        n = valid[b]
        t = min(q_len, n)  # the row's real queries: the last t
        # t == n: a prefill (causal); t == 1: a decode step (sees all n keys); else a chunk after cached
        # tokens, which needs the mask's real part.
        mask = None if t in (1, n) else attention_mask[b:b + 1, :, q_len - t:, kv_len - n:]
        out = _sdpa(q[:, :, q_len - t:], k[:, :, kv_len - n:], v[:, :, kv_len - n:], attn_mask=mask,
                    is_causal=t > 1 and mask is None, scale=scaling, enable_gqa=True)
        rows.append(out if t == q_len else nn.functional.pad(out, (0, 0, q_len - t, 0)))  # padding rows: zeros
    return torch.cat(rows).transpose(1, 2).contiguous(), None


AttentionInterface.register(ROWWISE_ATTENTION, rowwise_sdpa)
AttentionMaskInterface.register(ROWWISE_ATTENTION, sdpa_mask)  # the padding mask it reads


def quantize_int8(model: nn.Module) -> int:
    """Replace every `nn.Linear` of `model` (for a causal LM: the decoder layers' projections and the
    `lm_head`) by an `Int8Linear`, in place, and switch its attention to `rowwise_sdpa`; returns how many
    linears. The embedding lookup stays float, also when `lm_head` is tied to it. Call it once the model
    is on the CPU."""
    if not supported():
        raise RuntimeError("int8 needs torch's fbgemm engine, which this torch build lacks (x86 builds have it)")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"  # the forward's kernel needs fbgemm's packed weights
    try:
        for parent, name, linear in targets:
            if linear.weight.device.type != "cpu":
                raise ValueError(f"int8 quantisation runs on CPU only; {name} is on {linear.weight.device}")
            setattr(parent, name, Int8Linear(linear))
    finally:
        torch.backends.quantized.engine = engine
    if isinstance(model, PreTrainedModel):
        model.set_attn_implementation(ROWWISE_ATTENTION)
    return len(targets)
