"""A GGUF model built straight on its file's blocks, never as a float32 copy.

transformers' GGUF loader dequantizes every tensor to float32 before the model exists (4.9 GB for a 1B model, eight
times its Q4_K_M file), and the blocks path then packs the file again. Here the model is made on torch's meta device
from the file's config; what is not a matrix (norms, Qwen's biases and head norms) is read from the file; the
embedding table stays the file's rows, each looked-up row dequantized by gguf's arithmetic (the very floats
transformers would hold); every matrix is packed from the file (worker/weights/blocks.py). What is left on the meta
device is an error, never a silent half-loaded model.
"""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import quants
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from worker.weights import rope
from worker.weights.blocks import BlockError, FileTensor, quantize_blocks, read_tensors
from worker.weights.quant import plain_llama

ARCHES = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class FileEmbedding(nn.Module):
    """An embedding table in the file's blocks ([vocab, bytes a row], copied out of the mapped file, which can then
    close); a lookup dequantizes the rows it takes."""

    def __init__(self, tensor: FileTensor) -> None:
        super().__init__()
        self.rows, self.kind = np.array(tensor.data), tensor.kind
        self.num_embeddings, self.embedding_dim = tensor.data.shape[0], int(tensor.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        taken = self.rows[ids.reshape(-1).cpu().numpy()]
        values = quants.dequantize(taken, self.kind).reshape(*ids.shape, self.embedding_dim)
        return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(ids.device)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks={self.kind.name}"


def load(config: PretrainedConfig, path: str) -> PreTrainedModel:
    """The model of `config` (read from the GGUF file at `path`) on the file's blocks; BlockError where they
    cannot serve it, before anything large is read."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if not plain_llama(model):
        raise BlockError("GGUF blocks serve a float32 Llama-shaped model only (Llama, Mistral, Qwen 2 and 3)")
    arch = ARCHES.get(config.model_type)
    if arch is None:
        raise BlockError(f"gguf has no tensor names for {config.model_type}")
    tensors = read_tensors(path)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, parameter in list(model.named_parameters()):
        if name.rsplit(".", 2)[-2] in MATRICES or name == "lm_head.weight":
            continue  # packed from the file below
        module_name, _, attribute = name.rpartition(".")
        module = model.get_submodule(module_name)
        file_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if file_name not in tensors:
            raise BlockError(f"the file has no {file_name or name}")
        if name == "model.embed_tokens.weight":
            model.model.embed_tokens = FileEmbedding(tensors[file_name])
            continue
        values = quants.dequantize(tensors[file_name].data, tensors[file_name].kind)
        value = torch.from_numpy(np.array(values, np.float32)).reshape(parameter.shape)  # a copy: the file is read-only
        setattr(module, attribute, nn.Parameter(value, requires_grad=False))
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config)  # its frequencies, computed on the CPU
    rope.take_file_factors(model, tensors)
    quantize_blocks(model, path, tensors)
    left = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left:
        raise BlockError(f"nothing in the file for {', '.join(left[:4])}")
    return model.eval()
