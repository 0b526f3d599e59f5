"""An orthogonal rotation of a Llama's residual stream, folded into its weights before int8 quantisation.

Per-row int8 activations take one scale per token, set by its largest channel; the residual stream of a
Llama has a few channels far larger than the rest, so most channels are left with a handful of levels.
Turning the residual stream by an orthogonal matrix Q (a normalised Hadamard matrix, whose every entry is
+-1/sqrt(n)) spreads each outlier over all channels and leaves the model's function unchanged:

- RMSNorm only divides by the row's norm, which Q keeps; its per-channel gain is folded into the weights
  that read its output, so the norms become plain (gain 1);
- weights reading the stream (q, k, v, gate, up, lm_head) become W diag(g) Q, weights writing it (o, down)
  Q^T W, and the embedding table E Q.

The input of o_proj (each head's mix of values) gets a rotation of its own, per head: each value head's
rows become H^T W_v and o_proj's columns of each head W_o H, so that attention outputs are turned by H^T and
o_proj turns them back. The input of down_proj is made in the forward (silu(gate) * up), so no weight can
turn it: `InputRotation` does, one small product per layer, and down_proj's weights take the inverse.

Apart from that one product, only weights change, once, at load. Each row is still computed alone (batch
invariance holds), and the float model gives the same logits up to float rounding (tested).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import LlamaForCausalLM

from worker.weights import scripted

PALEY_PRIME = 11  # Paley's construction over GF(11) gives a Hadamard matrix of order 12


def _paley12() -> torch.Tensor:
    """Order 12: I + S, where S is the skew matrix bordered around the quadratic-residue matrix of GF(11)."""
    q = PALEY_PRIME
    squares = {(x * x) % q for x in range(1, q)}
    skew = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    skew[0, 1:], skew[1:, 0] = 1, -1
    for i in range(q):
        for j in range(q):
            if i != j:
                skew[1 + i, 1 + j] = 1 if (j - i) % q in squares else -1
    return torch.eye(q + 1, dtype=torch.float64) + skew


def hadamard(n: int) -> torch.Tensor | None:
    """A normalised (orthogonal) Hadamard matrix of order n = 2**a * 12**b, float64; None for other n."""
    matrix, left = torch.ones(1, 1, dtype=torch.float64), n
    while left % 12 == 0:
        matrix, left = torch.kron(matrix, _paley12()), left // 12
    sylvester = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while left % 2 == 0:
        matrix, left = torch.kron(matrix, sylvester), left // 2
    return matrix / math.sqrt(n) if left == 1 else None


def orthogonal(n: int) -> torch.Tensor:
    """Hadamard where one exists for n; else a fixed-seed random orthogonal matrix (spreads outliers too)."""
    matrix = hadamard(n)
    if matrix is not None:
        return matrix
    q, r = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def rotate_residual(model: LlamaForCausalLM) -> None:
    """Fold a rotation of the residual stream into `model`'s weights, in place (see the module's text). The
    embedding table and the lm_head no longer share a tensor afterwards."""
    decoder, q = model.model, orthogonal(model.config.hidden_size)
    h = orthogonal(decoder.layers[0].self_attn.head_dim)
    embed = decoder.embed_tokens.weight  # a new tensor for it: lm_head keeps the old one, which it reads below
    decoder.embed_tokens.weight = nn.Parameter((embed.detach().double() @ q).to(embed.dtype), requires_grad=False)
    _read(decoder.norm, [model.lm_head], q)
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _read(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], q)
        _read(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], q)
        for writer in (attn.o_proj, mlp.down_proj):
            _set(writer, q.T @ writer.weight.detach().double())
        _rotate_heads(attn.v_proj, attn.o_proj, h)


def _rotate_heads(v_proj: nn.Linear, o_proj: nn.Linear, h: torch.Tensor) -> None:
    """Each value head's output turned by H^T, and o_proj's input of each attention head by H: the same H for
    all heads, so that query heads sharing a value head (grouped-query attention) agree."""
    head_dim = h.shape[0]
    values = v_proj.weight.detach().double()
    _set(v_proj, (h.T @ values.view(-1, head_dim, values.shape[-1])).reshape(values.shape))
    if v_proj.bias is not None:  # Qwen 2's: the bias is part of each head's output
        bias = v_proj.bias.detach().double().view(-1, head_dim, 1)
        v_proj.bias = nn.Parameter((h.T @ bias).reshape(-1).to(v_proj.bias.dtype), requires_grad=False)
    out = o_proj.weight.detach().double()
    _set(o_proj, (out.view(out.shape[0], -1, head_dim) @ h).reshape(out.shape))


def _read(norm: nn.Module, readers: list[nn.Linear], q: torch.Tensor) -> None:
    """The linears reading `norm`'s output take its gain and the rotation; the norm keeps a gain of 1."""
    gain = norm.weight.detach().double()
    for linear in readers:
        _set(linear, (linear.weight.detach().double() * gain) @ q)
    norm.weight.data.fill_(1.0)


def _set(linear: nn.Linear, weight: torch.Tensor) -> None:
    linear.weight = nn.Parameter(weight.to(linear.weight.dtype).contiguous(), requires_grad=False)


class InputRotation(nn.Module):
    """x -> x H in the forward, for an input that no weight writes (down_proj's: silu(gate) * up), where H is
    block-diagonal: a Hadamard matrix of order `block` on each run of `block` channels (one small matrix
    product per row; a Hadamard matrix over the whole row spread no better in the perplexity bench and cost
    twice the time). The linear reading it takes W H (`fold`), so that (x H)(W H)^T = x W^T."""

    BLOCK = 128

    def __init__(self, n: int) -> None:
        super().__init__()
        if not self.fits(n):
            raise ValueError(f"an input rotation needs a width that is a multiple of {self.BLOCK}, not {n}")
        self.n, self.block = n, hadamard(self.BLOCK).float()

    @property
    def sylvester(self) -> bool:
        """Whether the block is Sylvester's (an order of 2**a): a fast Walsh-Hadamard transform computes it."""
        return self.BLOCK & (self.BLOCK - 1) == 0

    @classmethod
    def fits(cls, n: int) -> bool:
        return n % cls.BLOCK == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scripted.rotate_blocks(x, self.block)

    def fold(self, linear: nn.Linear) -> None:
        """W H, block by block (H is block-diagonal: no n x n matrix is built)."""
        weight = linear.weight.detach().double()
        blocks = weight.view(weight.shape[0], self.n // self.BLOCK, self.BLOCK) @ hadamard(self.BLOCK)
        _set(linear, blocks.reshape(weight.shape))
