"""worker/weights' choice of a model's path, pure: from WORKER_QUANT, the device, whether the model comes from a
local GGUF file, and whether torch has int8 kernels. (Putting a model on each path is tested where the path is:
test_blocks, test_quant, test_native.)"""

from __future__ import annotations

import pytest
import torch

from worker.weights.paths import choose

CPU, GPU = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(("setting", "device", "gguf", "int8", "path"), [
    ("auto", CPU, "model.gguf", True, "gguf"),  # the default model: its file's own blocks
    ("auto", CPU, None, True, "int8"),  # any other model on a CPU
    ("auto", CPU, None, False, "none"),  # a CPU torch has no int8 kernels for
    ("auto", GPU, "model.gguf", True, "none"),  # a GPU runs the float model
    ("int8", CPU, "model.gguf", True, "int8"),
    ("none", CPU, "model.gguf", True, "none"),
    ("gguf", CPU, "model.gguf", True, "gguf"),
])
def test_each_setting_device_and_model_takes_its_path(setting: str, device: torch.device, gguf: str | None,
                                                      int8: bool, path: str) -> None:
    assert choose(setting, device, gguf, int8) == path


@pytest.mark.parametrize(("setting", "device", "gguf", "message"), [
    ("q4", CPU, None, "WORKER_QUANT must be auto, gguf, int8 or none"),
    ("int8", GPU, None, "WORKER_QUANT=int8 runs on CPU only"),
    ("gguf", GPU, "model.gguf", "WORKER_QUANT=gguf runs on CPU only"),
    ("gguf", CPU, None, "WORKER_QUANT=gguf needs a local GGUF file"),
])
def test_a_setting_that_cannot_be_kept_fails_at_once_naming_it(setting: str, device: torch.device,
                                                                gguf: str | None, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        choose(setting, device, gguf, True)
