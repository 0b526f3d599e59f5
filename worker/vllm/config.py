"""vLLM's engine configuration for a worker: the settings' engine arguments (worker/vllm/model.py), then the flags
of VLLM_ENGINE_ARGS over them, parsed by vLLM's own `vllm serve` argument parser, so that a user's command line
moves over unchanged; and the configuration made as `vllm serve` makes it, so that what the flags leave out
(the batch budget, the sequence cap, chunked prefill) defaults to what `vllm serve` picks on this device.
Imported only where vLLM is."""

from __future__ import annotations

import argparse
import shlex
from typing import Any, NoReturn

from common.errors import SettingsError
from common.settings import WorkerSettings
from worker.vllm.model import engine_arguments

# Flags that name what other settings own: the model is MODEL (and MODEL_FILE), the one the gateway routes by.
OWNED = {"model": "MODEL", "served_model_name": "SERVED_MODEL_NAME"}


def _refuse(message: str) -> NoReturn:
    raise SettingsError(f"VLLM_ENGINE_ARGS: {message}")


def given_flags(text: str) -> dict[str, Any]:
    """The engine arguments VLLM_ENGINE_ARGS gives, by EngineArgs field, and only those it gives: every default
    of vLLM's parser is suppressed, so that the settings' own values stand where the flags say nothing."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        argv = shlex.split(text)
    except ValueError as exc:
        _refuse(str(exc))
    if argv[:1] == ["serve"] or (argv and not argv[0].startswith("-")):
        _refuse("give the engine flags alone: the model is MODEL's (no `vllm serve MODEL`)")
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="VLLM_ENGINE_ARGS"))
    for action in parser._actions:  # argparse keeps no public list of them
        action.default = argparse.SUPPRESS
    parser.error = _refuse  # an unknown flag or a bad value: a SettingsError naming the variable, not an exit
    given = vars(parser.parse_args(argv))
    for field, setting in OWNED.items():
        if field in given:
            _refuse(f"--{field.replace('_', '-')} is set by {setting}")
    return given


def engine_args(settings: WorkerSettings, path: str, cuda: bool) -> Any:
    """vLLM's EngineArgs: the settings' arguments, VLLM_ENGINE_ARGS's flags over them."""
    from vllm.engine.arg_utils import EngineArgs

    given = given_flags(settings.vllm_engine_args) if settings.vllm_engine_args.strip() else {}
    return EngineArgs(**{**engine_arguments(settings, path, cuda), **given})


def engine_config(settings: WorkerSettings, path: str, cuda: bool) -> Any:
    """The VllmConfig the worker's engine runs, made in `vllm serve`'s usage context. Values vLLM refuses
    together (its configs check them) fail the start naming the variable, as a bad setting does."""
    from vllm.usage.usage_lib import UsageContext

    arguments = engine_args(settings, path, cuda)
    try:
        return arguments.create_engine_config(UsageContext.OPENAI_API_SERVER)
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise SettingsError(f"VLLM_ENGINE_ARGS (with the VLLM_* settings): vLLM refuses them: {exc}") from None
