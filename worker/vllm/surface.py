"""What ENGINE=vllm uses of vLLM, as data: each module, name, class member and method signature the worker's code
reaches for, so that a vLLM release can be checked against it without a GPU, from the source text of its wheel
(tests/vllm_wheels.py downloads each release the `vllm` extra allows), or from an installed vLLM.

Two model runners take custom logits processors by two interfaces (worker/vllm/resume.py): Model Runner V2's is
needed by every release (CUDA hosts run V2 from 0.32 on, and only V2 from 0.34), V1's only by releases that can
still pick the V1 runner (their VllmConfig has `use_v2_model_runner`). tests/test_vllm_surface.py checks that
every vLLM import in worker/vllm/ is listed here, so the list cannot fall behind the code.

Pure: no vLLM import; the check reads Python source with `ast`."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass

# Source of a module's file in a vLLM tree: its text, or None where the file is not there.
Reader = Callable[[str], str | None]


@dataclass(frozen=True)
class Use:
    """`name` of `module` (a class, function or value; "" for the module itself) and, for a class, `members`
    it (or a base class in vLLM) defines: methods, properties, fields, attributes set on self. A member written
    `apply(logits, ctx)` must take exactly those parameters after self."""

    module: str
    name: str = ""
    members: tuple[str, ...] = ()


# Every engine argument worker/vllm/model.py may set (VLLM_ENGINE_ARGS's are vLLM's own parser's).
ENGINE_ARGUMENTS = ("model", "dtype", "max_num_seqs", "enforce_eager", "enable_prefix_caching",
                    "structured_outputs_config", "max_logprobs", "tensor_parallel_size", "gpu_memory_utilization",
                    "seed", "max_model_len", "kv_cache_memory_bytes")

COMMON = (
    Use("vllm", "SamplingParams"),
    Use("vllm.sampling_params", "SamplingParams",
        ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "presence_penalty",
         "frequency_penalty", "logprobs", "detokenize", "logit_bias", "extra_args", "structured_outputs",
         "output_kind")),
    Use("vllm.sampling_params", "RequestOutputKind", ("DELTA",)),
    Use("vllm.sampling_params", "StructuredOutputsParams", ("grammar",)),
    Use("vllm.inputs", "TokensPrompt"),
    Use("vllm.engine.arg_utils", "EngineArgs", ("add_cli_args", "create_engine_config", *ENGINE_ARGUMENTS)),
    Use("vllm.utils.argparse_utils", "FlexibleArgumentParser", ("error",)),
    Use("vllm.usage.usage_lib", "UsageContext", ("OPENAI_API_SERVER",)),
    Use("vllm.platforms", "current_platform"),
    Use("vllm.v1.engine.llm_engine", "LLMEngine",
        ("from_vllm_config", "add_request", "step", "abort_request", "engine_core", "vllm_config")),
    Use("vllm.config.vllm", "VllmConfig", ("model_config", "scheduler_config")),
    Use("vllm.config.model", "ModelConfig", ("logits_processors", "max_model_len")),
    Use("vllm.config.scheduler", "SchedulerConfig", ("max_num_seqs", "max_num_batched_tokens")),
    Use("vllm.v1.metrics.loggers", "PrometheusStatLogger",
        ("record(scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)", "log_engine_initialized", "log")),
    Use("vllm.v1.core.sched.scheduler", "Scheduler",
        ("kv_cache_manager", "structured_output_manager", "requests", "block_size", "cache_config")),
    Use("vllm.v1.core.block_pool", "BlockPool", ("get_cached_block",)),
    Use("vllm.v1.request", "Request", ("block_hashes", "sampling_params", "request_id")),
    Use("vllm.v1.structured_output", "StructuredOutputManager", ("_create_grammar(request)",)),
)

# Model Runner V2's custom logits processors (worker/vllm/resume_v2.py).
RUNNER_V2 = (
    Use("vllm.v1.worker.gpu.sample.logits_processor", "LogitsProcessor",
        ("__init__(vllm_config, req_states)", "add_request(req_idx, sampling_params)", "apply(logits, ctx)")),
    Use("vllm.v1.worker.gpu.sample.logits_processor.interface", "LogitsProcRequestState",
        ("device", "all_token_ids", "prompt_len", "total_len")),
    Use("vllm.v1.worker.gpu.sample.logits_processor.interface", "LogitsContext",
        ("idx_mapping_np", "expanded_idx_mapping", "seq_lens_upper_bound_np")),
    Use("vllm.v1.worker.gpu.buffer_utils", "UvaBackedTensor", ("np", "gpu")),
    Use("vllm.v1.worker.gpu.buffer_utils", "StagedWriteTensor", ("gpu",)),
)

# The V1 model runner's (worker/vllm/resume_v1.py), where a release can still pick that runner.
RUNNER_V1 = (
    Use("vllm.v1.sample.logits_processor", "LogitsProcessor",
        ("__init__(vllm_config, device, is_pin_memory)", "apply(logits)", "update_state(batch_update)",
         "is_argmax_invariant()")),
    Use("vllm.v1.sample.logits_processor", "BatchUpdate", ("added", "removed", "moved")),
    Use("vllm.v1.sample.logits_processor", "MoveDirectionality", ("SWAP",)),
)

# Where a release decides between the runners (worker/vllm/resume.py's runner_interface).
RUNNER_CHOICE = Use("vllm.config.vllm", "VllmConfig", ("use_v2_model_runner",))


def needed(read: Reader) -> tuple[Use, ...]:
    """What the worker needs of the vLLM tree `read` reads: V1's interface only where V1 can still be picked."""
    has_v1 = not problems([RUNNER_CHOICE], read)
    return COMMON + RUNNER_V2 + (RUNNER_V1 if has_v1 else ())


def problems(uses: Iterable[Use], read: Reader) -> list[str]:
    """Each use the tree lacks, in words (empty: all there)."""
    tree = _Tree(read)
    found = []
    for use in uses:
        found += tree.lacks(use)
    return found


class _Tree:
    """Module files of a vLLM tree parsed on demand, and names resolved through their imports."""

    def __init__(self, read: Reader) -> None:
        self.read = read
        self.parsed: dict[str, ast.Module | None] = {}
        self.packages: set[str] = set()

    def module(self, name: str) -> ast.Module | None:
        if name not in self.parsed:
            path = name.replace(".", "/")
            text = self.read(f"{path}.py")
            if text is None:
                text = self.read(f"{path}/__init__.py")
                self.packages.add(name)
            self.parsed[name] = ast.parse(text) if text is not None else None
        return self.parsed[name]

    def absolute(self, module: str, node: ast.ImportFrom) -> str:
        """The module a `from ... import` in `module` names, relative imports made absolute."""
        if not node.level:
            return node.module or ""
        parts = module.split(".")
        base = parts if module in self.packages else parts[:-1]
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def lacks(self, use: Use) -> list[str]:
        where = f"{use.module}.{use.name}" if use.name else use.module
        if self.module(use.module) is None:
            return [f"no module {use.module}"]
        if not use.name:
            return []
        found = self.resolve(use.module, use.name)
        if found is None:
            return [f"{where} is gone"]
        if not use.members:
            return []
        module, node = found
        if not isinstance(node, ast.ClassDef):
            return [f"{where} is not a class"]
        return [f"{where}.{member}: {why}" for member in use.members
                if (why := self.member_problem(module, node, member))]

    def resolve(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """The node that defines `name` in `module`, following `from x import name` re-exports."""
        tree = self.module(module)
        if tree is None or depth > 8:
            return None
        for node in _top_level(tree):
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
                return module, node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return module, node
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                return module, node
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        return self.resolve(self.absolute(module, node), alias.name, depth + 1)
        return None

    def member_problem(self, module: str, cls: ast.ClassDef, member: str, depth: int = 0) -> str:
        """"" if the class (or a base class in the tree) has `member` with the parameters it names."""
        name, _, params = member.partition("(")
        for node in cls.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                if not params:
                    return ""
                wanted = [p.strip() for p in params.rstrip(")").split(",") if p.strip()]
                got = [a.arg for a in node.args.args + node.args.kwonlyargs][1:]  # less self / cls
                return "" if got == wanted else f"takes ({', '.join(got)}), the worker passes ({', '.join(wanted)})"
        if not params and name in _attributes(cls):
            return ""
        why = "gone"
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
            found = self.resolve(module, base_name) if base_name and depth < 8 else None
            if found is None or not isinstance(found[1], ast.ClassDef):
                continue
            why = self.member_problem(found[0], found[1], member, depth + 1)
            if why != "gone":
                return why  # found there: fine, or taking other parameters
        return why


def _top_level(tree: ast.Module) -> list[ast.AST]:
    """Module-level statements, those inside if / try blocks too (TYPE_CHECKING, version switches)."""
    out: list[ast.AST] = []
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.If | ast.Try):
            pending += node.body + node.orelse + getattr(node, "finalbody", [])
            pending += [s for handler in getattr(node, "handlers", []) for s in handler.body]
        else:
            out.append(node)
    return out


def _attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class defines besides its methods: fields and class values, and attributes set on self."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [target] if target is not None else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                names.add(t.attr)
    return names


def imports_in(source: str) -> set[tuple[str, str]]:
    """(module, name) of every `from vllm... import name` in a file's source ((module, "") for `import vllm.x`)."""
    found: set[tuple[str, str]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vllm":
            found |= {(node.module, alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "vllm"}
    return found
