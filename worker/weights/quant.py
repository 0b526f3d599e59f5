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

import functools
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn
from transformers import AttentionInterface, Cache, LlamaForCausalLM, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
from transformers.models.qwen2 import Qwen2ForCausalLM
from transformers.models.qwen3 import Qwen3ForCausalLM

from worker.weights import native, scripted
from worker.weights.rotation import InputRotation, rotate_residual
from worker.weights.scripted import EPS

WEIGHT_MAX = 63  # weights: 7 bits, so that fbgemm's int16 pair sums cannot saturate (see above)
ROWWISE_ATTENTION = "llmserve_rowwise_sdpa"
# Rotary types whose cos and sin depend on the position alone (`dynamic`'s and `longrope`'s change with the
# forward's length, which would make a row's result depend on its batch).
POSITIONAL_ROPE = ("default", "linear", "llama3", "yarn")


def supported() -> bool:
    """fbgemm is in torch's x86 builds; ARM builds lack it."""
    return "fbgemm" in torch.backends.quantized.supported_engines


@runtime_checkable
class AttendingLayer(Protocol):
    """A cache layer that writes a forward's keys and values and attends in one compiled call (the own engine's
    ragged cache, worker/weights/ragged.py): the seam keeps these model paths free of the engine's cache types."""

    def write_and_attend(self, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                         scaling: float) -> torch.Tensor: ...

    def attend_with(self, shape: torch.Tensor,
                    call: Callable[[list[torch.Tensor], list[torch.Tensor], list[int]], torch.Tensor]
                    ) -> torch.Tensor: ...


@functools.cache
def _attending_type(kind: type) -> bool:
    return issubclass(kind, AttendingLayer)


def attending(layer: object) -> bool:
    """isinstance(layer, AttendingLayer), known once per type: a protocol's own check walks its members on every
    call (microseconds, 30 times a decode step)."""
    return _attending_type(type(layer))


class Int8Linear(nn.Module):
    """Drop-in for an `nn.Linear` on CPU: int8 weights, per-row int8 activations, float in and out."""

    def __init__(self, *linears: nn.Linear, native: bool = False) -> None:
        """One layer, or several over the same input fused into one (their outputs side by side): the
        row scale is the shared input's and the weight scales are per output channel, so fusing changes
        no bit of any output, and one kernel call does the work of several."""
        super().__init__()
        self.in_features, self.out_features = linears[0].in_features, sum(lin.out_features for lin in linears)
        weight = torch.cat([lin.weight.detach().float() for lin in linears])
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
        biases = [torch.zeros(lin.out_features) if lin.bias is None else lin.bias.detach().float() for lin in linears]
        has_bias = any(lin.bias is not None for lin in linears)
        self.bias = nn.Parameter(torch.cat(biases), requires_grad=False) if has_bias else None
        self.native = native  # worker/weights/native.cpp's call for float32: the same bits, less overhead

    @functools.cached_property
    def weight(self) -> int:
        """The number worker/weights/native.cpp's kernels know the packed weights by (passing the packed object itself
        costs more than a small product: native.cpp), given on first use (the kernels must be loaded,
        worker/weights/native.py) and taken back when this layer goes."""
        number = native.ops.keep_weight(self.packed)
        weakref.finalize(self, native.ops.drop_weight, number)
        return number

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("weight", None)  # a copy (or a pickle) asks for a number of its own
        return state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.float32:
            return native.ops.int8_linear(x, self.weight, self.bias, None)
        return scripted.int8_linear(x, self.packed, self.bias, None)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def rowwise_sdpa(module: nn.Module, query: torch.Tensor, key: torch.Tensor | list[torch.Tensor],
                 value: torch.Tensor | list[torch.Tensor], attention_mask: torch.Tensor | None,
                 scaling: float | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention without padding: each row is computed over its own tokens only, by a
    call of the very shapes it would make alone, so its result cannot depend on the rest of the batch.
    Consecutive rows of one length (requests admitted together, or all rows at batch 1) share a call:
    the kernel computes each row of an unpadded batch as it would compute that row alone (tested).
    Assumes left padding (the engine's and `generate`'s), read off the mask's last query row, and a
    decoder in eval mode (causal, no dropout, no softcap). `key` and `value` may also be lists of each
    row's own ([1, heads, n, dim], worker/weights/ragged.py): then each row is its own call."""
    other = [name for name in ("sliding_window", "softcap") if kwargs.get(name)]
    other += ["position_bias"] if kwargs.get("position_bias") is not None else []
    if other:
        raise NotImplementedError(f"int8's row-wise attention handles plain causal attention only, not a "
                                  f"{' or '.join(other)}")
    if isinstance(key, list):  # (a compiled layer's decode step never comes here: AttendingLayer.write_and_attend)
        return scripted.attend_rows(query, key, value, attention_mask, scaling), None
    batch, kv_len = query.shape[0], key.shape[2]
    if attention_mask is None:
        valid = [kv_len] * batch
    else:
        last = attention_mask[:, 0, -1]
        valid = (last if last.dtype == torch.bool else last == 0).sum(dim=-1).tolist()
    runs, start = [], 0
    for end in range(1, batch + 1):
        if end == batch or valid[end] != valid[start]:
            runs.append(scripted.attend(query[start:end], key[start:end], value[start:end], attention_mask, start,
                                        valid[start], scaling))
            start = end
    return (runs[0] if len(runs) == 1 else torch.cat(runs)).transpose(1, 2).contiguous(), None


AttentionInterface.register(ROWWISE_ATTENTION, rowwise_sdpa)
AttentionMaskInterface.register(ROWWISE_ATTENTION, sdpa_mask)  # the padding mask it reads


class RowwiseLlamaLayer(nn.Module):
    """A Llama decoder layer whose attention reads each row's own keys (`rowwise_sdpa`, worker/weights/ragged.py
    rows), around two products that a subclass supplies: `project_qkv` (q, k and v fused) and `mlp_residual`
    (o_proj, the MLP and both residuals). Every product takes each token alone, so each row's result is the one
    it gets alone."""

    def __init__(self, layer: LlamaDecoderLayer, native: bool) -> None:
        super().__init__()
        attn = layer.self_attn
        self.layer_idx, self.scaling, self.head_dim = attn.layer_idx, attn.scaling, attn.head_dim
        self.q_heads = attn.q_proj.out_features // self.head_dim
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.norm_eps = self.input_layernorm.variance_epsilon
        self.native = native  # worker/weights/native.cpp's heads and attention
        # Qwen 3's RMSNorm of each query and key head before the rotation (its eps is the layers'): [] for none.
        norms = [getattr(attn, name, None) for name in ("q_norm", "k_norm")]
        self.head_norms = [n.weight.detach().float().contiguous() for n in norms] if norms[0] is not None else []

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The normed tokens' fused q, k and v projections ([tokens, width] in)."""
        raise NotImplementedError

    def mlp_residual(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer after attention: x + o_proj(attended), then the MLP of its norm and that residual."""
        raise NotImplementedError

    @staticmethod
    def forward_stack(layers: Sequence[RowwiseLlamaLayer], hidden: list[torch.Tensor],
                      rope: list[tuple[torch.Tensor, torch.Tensor]], masks: list[torch.Tensor | None],
                      caches: list[Cache]) -> list[torch.Tensor]:
        """`forward_parts` through every decoder layer in turn (a subclass may take them all in one call)."""
        for layer in layers:
            hidden = layer.forward_parts(hidden, rope, masks, caches)
        return hidden

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, cache: Cache | None = None,
                **kwargs: object) -> torch.Tensor:
        rope = rotary_factors(*position_embeddings)
        return self.forward_parts([hidden_states], [rope], [attention_mask], [cache])[0]

    def forward_parts(self, hidden: list[torch.Tensor], rope: list[tuple[torch.Tensor, torch.Tensor]],
                      masks: list[torch.Tensor | None], caches: list[Cache]) -> list[torch.Tensor]:
        """Several forwards in one pass (worker/own/forward.py): part i is hidden[i] ([rows, length, width]) with
        the rotary factors rope[i] (`rotary_factors`) over caches[i]. Their rows go side by side through every
        int8 call, and each part attends over its own cache, so each part's result is the one its own forward
        gives, bit for bit."""
        shapes = [h.shape[:2] for h in hidden]
        sizes = [rows * length for rows, length in shapes]
        x = _cat([h.reshape(n, -1) for h, n in zip(hidden, sizes, strict=True)])
        qkv = self.project_qkv(x)
        attended = _cat([self._attend(part, rows, length, *factors, mask, cache).reshape(rows * length, -1)
                         for part, (rows, length), factors, mask, cache
                         in zip(_split(qkv, sizes), shapes, rope, masks, caches, strict=True)])
        x = self.mlp_residual(x, attended)
        return [part.view(rows, length, -1) for part, (rows, length) in zip(_split(x, sizes), shapes, strict=True)]

    def _attend(self, qkv: torch.Tensor, rows: int, length: int, cos: torch.Tensor, signed_sin: torch.Tensor,
                mask: torch.Tensor | None, cache: Cache | None) -> torch.Tensor:
        """Attention of one part, from its fused projections ([rows * length, (q + 2 kv heads) * head_dim])."""
        heads = native.ops.heads if self.native else scripted.heads
        norm_heads(qkv, self.head_norms, self.head_dim, self.q_heads, self.kv_heads, self.norm_eps)
        query, key, value = heads(qkv, rows, length, self.head_dim, self.q_heads, self.kv_heads, cos, signed_sin)
        if self.native and cache is not None and attending(cache.layers[self.layer_idx]):
            # A ragged row has no padding: token i of the part sees its row's cache and the part up to i, which
            # is what the mask says (worker/own/forward.py's causal_mask)
            return cache.layers[self.layer_idx].write_and_attend(query, key, value, self.scaling)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, {"native": self.native})
        return rowwise_sdpa(self, query, key, value, mask, scaling=self.scaling)[0]


class Int8LlamaLayer(RowwiseLlamaLayer):
    """A Llama decoder layer in four int8 kernel calls instead of seven (q, k and v fused, gate and up
    fused), in a few scripted functions (worker/weights/scripted.py) instead of a tree of modules: at batch 1 a decode
    step is mostly per-call overhead, paid 30 times per token. Same arithmetic as the layer it replaces, row by
    row."""

    def __init__(self, layer: LlamaDecoderLayer, down_rotation: InputRotation | None = None,
                 native: bool = False) -> None:
        """With `down_rotation`, down_proj's input is rotated in the forward and its weights take the
        rotation (worker/weights/rotation.py): its activations' outliers are spread before they are quantised. With
        `native`, a layer whose norms are folded runs worker/weights/native.cpp's kernels (torch.ops.llmserve)."""
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        # Gains of 1 (after worker/weights/rotation.py): None, and each norm is folded into the int8 call reading it.
        folded = all(bool((n.weight == 1).all()) for n in norms)
        # The kernels take float32 (the CPU default; WORKER_DTYPE=bfloat16 keeps the scripted layer).
        super().__init__(layer, native and folded and norms[0].weight.dtype == torch.float32
                         and (down_rotation is None or down_rotation.sylvester))
        attn, mlp = layer.self_attn, layer.mlp
        self.down_rotation = down_rotation
        if down_rotation is not None:
            down_rotation.fold(mlp.down_proj)
        self.qkv = Int8Linear(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o_proj = Int8Linear(attn.o_proj)
        self.gate_up = Int8Linear(mlp.gate_proj, mlp.up_proj)
        self.down_proj = Int8Linear(mlp.down_proj)
        self.gains = (None, None) if folded else tuple(n.weight for n in norms)

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """The normed tokens' fused q, k and v projections ([tokens, width] in)."""
        if self.native:
            return native.ops.int8_linear(x, self.qkv.weight, self.qkv.bias, self.norm_eps)
        return scripted.normed_linear(x, self.qkv.packed, self.gains[0], self.norm_eps, self.qkv.bias)

    def mlp_residual(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer after attention: x + o_proj(attended), then the MLP of its norm and that residual."""
        rotation = None if self.down_rotation is None else self.down_rotation.block
        if self.native:
            return native.ops.mlp_residual(x, attended, self.o_proj.weight, self.gate_up.weight,
                                           self.down_proj.weight, self.norm_eps,
                                           0 if rotation is None else rotation.shape[0])
        return scripted.mlp_residual(x, attended, self.o_proj.packed, self.gate_up.packed, self.down_proj.packed,
                                     self.gains[1], self.norm_eps, rotation)


def norm_heads(qkv: torch.Tensor, gains: list[torch.Tensor], head_dim: int, q_heads: int, kv_heads: int,
               eps: float) -> None:
    """Qwen 3's RMSNorm of each query and key head, in place on the fused projection ([tokens, n]), as blocks.cpp's
    norm_heads and transformers compute it; nothing where `gains` is empty."""
    for gain, start, heads in zip(gains, (0, q_heads * head_dim), (q_heads, kv_heads), strict=False):
        h = qkv.narrow(1, start, heads * head_dim).unflatten(1, (heads, head_dim))
        h.mul_(h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()).mul_(gain)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _split(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return [x] if len(sizes) == 1 else list(x.split(sizes))


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What every layer's rotary embedding multiplies by, made once per forward ([rows, length, head_dim] in,
    with a heads axis out). Llama's rotation pairs each half of a head with the other, the first half negated:
    x * cos + cat(-x2, x1) * sin. The minus moves onto sin's first half, which leaves every product the same
    number, and the swap of halves becomes one roll: four small ops per layer instead of nine."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)


def plain_llama(model: nn.Module) -> bool:
    """A Llama-shaped decoder (what Int8LlamaLayer computes): Llama without biases; Qwen 2's (Qwen 2 and 2.5),
    Llama with biases on q, k and v; Qwen 3's, Llama with an RMSNorm on each query and key head; neither Qwen
    with its sliding window. A SiLU MLP; a rotary embedding that depends on the position alone (the cos and sin
    the model's own rotary embedding gives each position)."""
    config = getattr(model, "config", None)
    if isinstance(model, LlamaForCausalLM):
        shape = not config.mlp_bias and not config.attention_bias
    elif isinstance(model, Qwen2ForCausalLM | Qwen3ForCausalLM):
        shape = ("sliding_attention" not in (config.layer_types or [])
                 and not getattr(config, "attention_bias", False))
    else:
        return False
    return (shape and config.hidden_act == "silu"
            and (config.rope_parameters or {}).get("rope_type") in POSITIONAL_ROPE)


def attention_unserved(model: PreTrainedModel) -> str | None:
    """Why `rowwise_sdpa` cannot compute `model`'s attention (a sliding window, a softcap: Gemma, Mistral 7B v0.1),
    or None. Asked of the model itself: one forward of two tokens with it, before anything is quantized."""
    before = model.config._attn_implementation
    model.set_attn_implementation(ROWWISE_ATTENTION)
    try:
        with torch.inference_mode():
            model(torch.zeros((1, 2), dtype=torch.long, device=model.device))
    except NotImplementedError as error:
        return f"{model.config.model_type}'s attention: {error}"
    finally:
        model.set_attn_implementation(before)
    return None


def takes_blocks_together(model: nn.Module) -> bool:
    """Whether a forward over several blocks of a prompt gives each token the very numbers of its own block's
    forward: every layer compiled (worker/weights/native.cpp), whose products take each token alone and whose attention
    computes each query in its own vector lane, over runs of keys fixed from the first key, the keys it must not
    see adding exact zeros."""
    return takes_rows_alone(model) and all(layer.native for layer in model.model.layers)


def takes_rows_alone(model: nn.Module) -> bool:
    """Whether every decoder layer is a `RowwiseLlamaLayer` (int8 or the GGUF blocks), whose attention takes each
    row's own keys and values: its cache may then hold rows side by side without padding (worker/weights/ragged.py)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return bool(layers) and all(isinstance(layer, RowwiseLlamaLayer) for layer in layers)


def use_native(model: nn.Module, on: bool) -> None:
    """Switch `model`'s int8 layers to worker/weights/native.cpp's kernels or back to the scripted ones (benches and
    tests compare the two in one process; the kernels must be loaded, worker/weights/native.py)."""
    for module in model.modules():
        if isinstance(module, Int8Linear | Int8LlamaLayer):
            module.native = on


def quantize_int8(model: nn.Module, rotate: bool = True, native: bool = False) -> int:
    """Replace every `nn.Linear` of `model` (for a causal LM: the decoder layers' projections and the
    `lm_head`) by an `Int8Linear`, in place, and switch its attention to `rowwise_sdpa`; returns how many
    linears. A Llama-shaped model's decoder layers (`plain_llama`) become `Int8LlamaLayer`s, with fused
    projections, after its residual stream is rotated, and with down_proj's input rotated
    (worker/weights/rotation.py), unless not `rotate`. The embedding lookup stays float, also when `lm_head` is
    tied to it. With `native`, the layers call native.cpp's kernels (which native.py must have loaded). Call it
    once the model is on the CPU."""
    if not supported():
        raise RuntimeError("int8 needs torch's fbgemm engine, which this torch build lacks (x86 builds have it)")
    linears = _linears(model)
    for _, name, linear in linears:
        if linear.weight.device.type != "cpu":
            raise ValueError(f"int8 quantisation runs on CPU only; {name} is on {linear.weight.device}")
    engine = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"  # the forward's kernel needs fbgemm's packed weights
    try:
        if plain_llama(model):
            if rotate:
                rotate_residual(model)
            width = model.config.intermediate_size
            down = InputRotation(width) if rotate and InputRotation.fits(width) else None
            layers = model.model.layers
            for index, layer in enumerate(layers):
                layers[index] = Int8LlamaLayer(layer, down, native)
        for parent, name, linear in _linears(model):  # those the fused layers did not take: the lm_head
            setattr(parent, name, Int8Linear(linear, native=native))
    finally:
        torch.backends.quantized.engine = engine
    if isinstance(model, PreTrainedModel):
        model.set_attn_implementation(ROWWISE_ATTENTION)
    return len(linears)


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if isinstance(child, nn.Linear)]
