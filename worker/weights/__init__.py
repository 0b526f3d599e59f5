"""The own engine's model paths: what a model's linear layers, and the layer glue around them, run on. One module
per weight format, each saying what it runs; `choose` and `load` in paths.py are the one place that picks the path,
from the model's files, the device and the settings (WORKER_QUANT, WORKER_NATIVE).

- gguf (blocks.py, blocks.cpp): the GGUF file's own blocks as Q4_1 or Q8_0 blocks (transcode.py), each token's
  activations in 8 bits a block of 32, the model built from the file alone (from_file.py), Llama 3's rotary scaling
  read from it (rope.py). Chosen by `auto` on an x86 CPU for a local GGUF file of a Llama-shaped model (Llama,
  Mistral, Qwen 2 and 3), with the kernels loaded.
- int8 (quant.py, rotation.py): 8-bit weights per output channel after a Hadamard rotation, 8-bit activations per
  row. Chosen by `auto` on a CPU for any other model, or where the blocks cannot serve; or by `int8`.
- The layer glue of both, rotary heads and attention: compiled (native.py, native.cpp; AVX-512, AVX2 and plain
  builds) wherever a C++ compiler builds them (`WORKER_NATIVE=auto`); else, for int8, the same arithmetic run by
  TorchScript (scripted.py), which is what serves where no compiler exists.
- none: transformers' own forward in float32 (bfloat16 on a GPU). On a GPU, where torch has no int8 kernels
  (fbgemm), or by `none`.
"""
