"""The benchmark tables of the README and docs/benchmarks.md, rendered from bench/results/*.json, so that no
figure in the documentation can drift from the run it came from.

Each results file is one benchmark on one kind of host (bench/provenance.py). The README gets one table per
host kind (a row per benchmark: its headline figures, command, commit and date), docs/benchmarks.md one small
table per benchmark and host kind; each between the marker comments below, the text around them untouched.

    python bench/tables.py            # rewrite both
    python bench/tables.py --check    # exit 1 when what is committed differs from what the results render
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PEER_PATH = re.compile(r"(--llama-server|--llama-perplexity|--llama-cpp-python|--vllm-python|--tools) \S+")
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
# The README shows the kinds a user can tell their host by; runs whose host was not recorded stay in the docs.
README_KINDS = ("gpu", "avx512", "avx2")
KIND_NAMES = {"gpu": "GPU hosts", "avx512": "AVX-512 hosts", "avx2": "AVX2 hosts (no AVX-512)",
              "unknown": "Host not recorded"}

Table = list[list[str]]


@dataclass
class Run:
    path: Path
    data: dict

    @property
    def benchmark(self) -> str:
        return str(self.data.get("benchmark") or self.path.stem.rsplit("-", 1)[0])

    @property
    def kind(self) -> str:
        return str(self.data.get("host_kind") or self.path.stem.rsplit("-", 1)[-1])

    @property
    def provenance(self) -> dict:
        return self.data.get("provenance") or {}

    def source(self) -> str:
        """The command, commit and date of the run, for a table row."""
        p = self.provenance
        command = PEER_PATH.sub(r"\1 PATH", str(p.get("command", "?")))  # where a peer was built is the host's
        return f"`{command}` | {str(p.get('commit', '?'))[:7]} | {str(p.get('at', '?'))[:10]}"


def num(value: float | None, unit: str = "") -> str:
    """A figure to about three significant digits, thousands grouped."""
    if value is None:
        return "-"
    size = abs(value)
    text = (f"{value:,.0f}" if size >= 100 else f"{value:.1f}" if size >= 10 else f"{value:.2f}" if size >= 0.1
            else f"{value:.3f}")
    return text + unit


def ms(seconds: float | None) -> str:
    return num(None if seconds is None else seconds * 1e3, " ms")


def pct(share: float, digits: int = 0) -> str:
    return f"{share:.{digits}%}"


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def slash(values: list[str]) -> str:
    return " / ".join(values)


# Each benchmark: (what it measures, a renderer from its file to its README headline and its docs table).
def peers(d: dict) -> tuple[str, Table]:
    series = d["series"]
    levels = [level["concurrency"] for level in series["llmserve"]]
    table = [["concurrency", *[f"{name} tok/s" for name in series], "TTFT p50", "ITL p50"]]
    for i, c in enumerate(levels):
        table.append([str(c), *[num(series[name][i]["output_tok_s"]) for name in series],
                      slash([ms(series[name][i]["ttft_s"]["p50"]) for name in series]),
                      slash([ms(series[name][i]["itl_s"]["p50"]) for name in series])])
    ours = slash([num(level["output_tok_s"]) for level in series["llmserve"]])
    head = f"output tok/s at concurrency {slash([str(c) for c in levels])}: llmserve {ours}"
    if "llama-server" in series:
        ratios = d["llmserve_over_llama_server"]
        head += (f", llama-server {slash([num(level['output_tok_s']) for level in series['llama-server']])} "
                 f"(**{slash([ratio(ratios[str(c)]['tok_s_ratio']) for c in levels])}**)")
    return head, table


def vllm_peers(d: dict) -> tuple[str, Table]:
    names, rows = list(d["series"]), d["table"]

    def figure(row: dict, name: str, key: str) -> str:
        return num(row[name][key]) if name in row else "-"

    table = [["concurrency", *[f"{name} tok/s" for name in names], f"TTFT p50 {slash(names)} (ms)",
              "stack on vLLM over vLLM's server"]]
    for row in rows:
        over = row.get("vllm_stack_over_server")
        table.append([str(row["concurrency"]), *[figure(row, name, "output_tok_s") for name in names],
                      slash([figure(row, name, "ttft_p50_ms") for name in names]),
                      ratio(over["output_tok_s"]) if over else "-"])
    head = (f"output tok/s at concurrency {slash([str(row['concurrency']) for row in rows])}: "
            + "; ".join(f"{name} {slash([figure(row, name, 'output_tok_s') for row in rows])}" for name in names))
    return head + ("" if d.get("complete", True) else " (cut short)"), table


def user_models(d: dict) -> tuple[str, Table]:
    files = d["files"]
    levels = [str(r["concurrency"]) for r in next(iter(files.values()))["llmserve_over_llama_server"]]
    table = [["file", "MB", "path", f"tok/s ratio at c = {slash(levels)}", "TTFT p50 llmserve / llama-server",
              "RSS (peak) MB llmserve / llama-server"]]
    for name, f in files.items():
        ratios, mem = f["llmserve_over_llama_server"], f["memory"]
        ttft = "; ".join(f"{ms(r['ttft_p50_s']['llmserve'])} / {ms(r['ttft_p50_s']['llama-server'])}" for r in ratios)
        memory = slash([f"{num(mem[s]['rss_mb'])} ({num(mem[s]['peak_mb'])})" for s in ("llmserve", "llama-server")])
        table.append([name, str(f["file_mb"]), f["weights_path"], slash([ratio(r["output_tok_s"]) for r in ratios]),
                      ttft, memory])
    head = "; ".join(f"{name} **{slash([ratio(r['output_tok_s']) for r in f['llmserve_over_llama_server']])}**"
                     for name, f in files.items())
    return f"output tok/s over llama-server's at concurrency {slash(levels)}: {head}", table


def user_models_long(d: dict) -> tuple[str, Table]:
    phases = d["settings"]["phases"]
    table = [["file", "server", *(f"TTFT p50, {phase}" for phase in phases)]]
    for name, f in d["files"].items():
        for server, medians in f["ttft_p50_s"].items():
            table.append([name, server, *(ms(medians[phase]) for phase in phases)])
    servers = " / ".join(next(iter(d["files"].values()))["ttft_p50_s"])
    head = "; ".join(f"{name} {slash([ms(medians[phases[-1]]) for medians in f['ttft_p50_s'].values()])}"
                     for name, f in d["files"].items())
    return f"TTFT p50 of the same prompts sent again at c = 4, {servers}: {head}", table


def prefix_cache(d: dict) -> tuple[str, Table]:
    summary = d["summary"]
    peer = any("llama-server" in figures for figures in summary.values())
    modes = ["on", "off", *(["llama-server"] if peer else [])]
    table = [["case", "TTFT p50 cached", "not cached", *(["llama-server"] if peer else []), "without / with",
              "prompt tokens from the cache", f"TTFT p99 {slash(modes)}", f"tok/s {slash(modes)}"]]
    for case, f in summary.items():
        table.append([case, ms(f["on"]["ttft_p50_s"]), ms(f["off"]["ttft_p50_s"]),
                      *([ms(f["llama-server"]["ttft_p50_s"])] if peer else []),
                      ratio(f["ttft_p50_off_over_on"]), f"{f['on']['prefix_hit_share']:.0%}",
                      slash([ms(f[mode]["ttft_p99_s"]) for mode in modes]),
                      slash([num(f[mode]["output_tok_s"]) for mode in modes])])
    first = next(iter(summary))
    f = summary[first]
    head = (f"TTFT p50 ({first}) {ms(f['on']['ttft_p50_s'])} with the prefix cache, {ms(f['off']['ttft_p50_s'])} "
            f"without (**{ratio(f['ttft_p50_off_over_on'])}**)")
    if peer:
        head += f", llama-server's prompt cache {ms(f['llama-server']['ttft_p50_s'])}"
    return head, table


def chunked_prefill(d: dict) -> tuple[str, Table]:
    summary = d["summary"]
    table = [["case", "ITL p50", "ITL p99", "ITL max", "p99 / no arrivals", "long prompts' TTFT p50"]]
    for case, f in summary.items():
        table.append([case, ms(f["itl_p50_s"]), ms(f["itl_p99_s"]), ms(f["itl_max_s"]),
                      ratio(f["itl_p99_over_no_arrivals"]) if "itl_p99_over_no_arrivals" in f else "-",
                      num(f.get("long_ttft_p50_s"), " s")])
    none, chunked, unchunked = summary["no arrivals"], summary["chunked"], summary["unchunked"]
    head = (f"ITL p99 of 16 streams while 2,000-token prompts arrive: {ms(chunked['itl_p99_s'])} chunked "
            f"(**{ratio(chunked['itl_p99_over_no_arrivals'])}** of {ms(none['itl_p99_s'])} with none), "
            f"{ms(unchunked['itl_p99_s'])} unchunked")
    return head, table


def sampling(d: dict) -> tuple[str, Table]:
    summary = d["summary"]
    levels = list(summary)
    table = [["workload", *[f"tok/s at c={c}" for c in levels]]]
    for name in summary[levels[0]]:
        table.append([name, *[num(summary[c][name]["output_tok_s"]) for c in levels]])
    head = (f"output tok/s at concurrency {slash(levels)}: " +
            "; ".join(f"{name} {slash([num(summary[c][name]['output_tok_s']) for c in levels])}"
                      for name in ("greedy", "OpenAI defaults")))
    return head, table


def stack_throughput(d: dict) -> tuple[str, Table]:
    table = [["figure", "value"],
             ["16 streams x 64 tokens through the stack", num(d["stack_c16_tok_s_median"], " tok/s")],
             ["the same prompts as one in-process `generate` batch", num(d["generate_static_b16_tok_s_median"],
                                                                         " tok/s")],
             ["the seed's design re-created (no KV cache, the prompt re-run per token, 4 slots)",
              num(d["seed_design_tok_s"], " tok/s")],
             ["one stream", num(d["c1_tok_s"], " tok/s")],
             ["TTFT p50 / p99 at 1", slash([ms(d["c1_ttft_p50_s"]), ms(d["c1_ttft_p99_s"])])],
             ["TTFT p50 / p99 at 16", slash([ms(d["c16_ttft_p50_s"]), ms(d["c16_ttft_p99_s"])])],
             ["ITL p50 / p99 at 1", slash([ms(d["c1_itl_p50_s"]), ms(d["c1_itl_p99_s"])])],
             ["ITL p50 / p99 at 16", slash([ms(d["c16_itl_p50_s"]), ms(d["c16_itl_p99_s"])])]]
    head = (f"16 streams: {num(d['stack_c16_tok_s_median'])} tok/s ({ratio(d['stack_over_generate'])} an "
            f"in-process `generate`, {ratio(d['stack_over_seed'])} the seed's design)")
    return head, table


def quality(d: dict) -> tuple[str, Table]:
    speed = d["speed_median"]
    table = [["figure", "fp32", "int8"]]
    for key, label in (("decode_ms_per_step_b1", "decode step, batch 1 (ms)"),
                       ("decode_ms_per_step_b16", "decode step, batch 16 (ms)"),
                       ("generate_tok_s_b1", "`generate`, batch 1 (tok/s)"),
                       ("generate_tok_s_b16", "`generate`, batch 16 (tok/s)")):
        table.append([label, num(speed[key]["fp32"]), num(speed[key]["int8"])])
    table += [["greedy answers identical to fp32's", "", f"{d['exact_match_share']:.0%}"],
              ["mean common prefix with fp32's", "", f"{d['mean_prefix_agreement']:.0%}"],
              ["tokens ranked first by both on the same text", "", f"{d['teacher_forced_top1_agreement']:.0%}"],
              ["batch-invariant answers", d["batch_invariant"]["fp32"], d["batch_invariant"]["int8"]]]
    b1, b16 = speed["decode_ms_per_step_b1"], speed["decode_ms_per_step_b16"]
    head = (f"int8 decode step {ratio(b1['fp32'] / b1['int8'])} / {ratio(b16['fp32'] / b16['int8'])} faster than "
            f"fp32 at batch 1 / 16; {d['teacher_forced_top1_agreement']:.0%} of tokens ranked first by both")
    return head, table


def batching(d: dict) -> tuple[str, Table]:
    s = d["summary"]
    table = [["batching", "tok/s", "e2e p50", "e2e p99", "TTFT p50"]]
    for mode, f in s.items():
        table.append([mode, num(f["output_tok_s"]), num(f["e2e_p50_s"], " s"), num(f["e2e_p99_s"], " s"),
                      num(f["ttft_p50_s"], " s")])
    c, st = s["continuous"], s["static"]
    head = (f"Poisson arrivals at {d['setup']['rate']} req/s: continuous {num(c['output_tok_s'])} vs static "
            f"{num(st['output_tok_s'])} tok/s, e2e p99 {num(c['e2e_p99_s'], ' s')} vs {num(st['e2e_p99_s'], ' s')}")
    return head, table


def burst(d: dict) -> tuple[str, Table]:
    out = d["outcomes"]
    lost = d["burst"] - sum(out.values())
    table = [["figure", "value"], ["queue limit (`MAX_QUEUE`)", str(d["queue_limit"])], ["burst", str(d["burst"])],
             *[[outcome, str(count)] for outcome, count in out.items()], ["lost", str(lost)],
             ["streams running meanwhile, intact", f"{d['in_flight_intact']} of {d['in_flight_streams']}"]]
    head = (f"{d['burst']} requests at `MAX_QUEUE={d['queue_limit']}`: {out.get('completed', 0)} completed, "
            f"{out.get('rejected', 0)} refused with 429, {lost} lost")
    return head, table


def faults(d: dict, cases: list[str]) -> Table:
    table = [["case", "completed", "migrated", "failed with an error", "lost", "duplicated tokens",
              "texts equal to the fault-free run", "next token after the fault, p50 / max"]]
    for case in cases:
        f = d[case]
        table.append([case, str(f["completed"]), str(f["migrated"]), str(f["failed_with_error"]), str(f["lost"]),
                      str(f["duplicated_tokens"]), str(f["text_equal_to_fault_free"]),
                      slash([num(f["fault_to_next_token_s_median"], " s"), num(f["fault_to_next_token_s_max"], " s")])
                      + (f"; worker exited after {num(f['worker_exit_s'], ' s')}" if "worker_exit_s" in f else "")])
    return table


def chaos(d: dict) -> tuple[str, Table]:
    cases = [key for key in d if isinstance(d[key], dict) and "completed" in d[key]]
    kill = d["worker_kill_9"]
    head = (f"{d['streams']} streams through each fault: worker kill -9 {kill['completed']} completed "
            f"({kill['migrated']} migrated), {kill['lost']} lost; Redis restart "
            f"{d['redis_restart']['failed_with_error']} ended with an error, {d['redis_restart']['lost']} lost")
    return head, faults(d, cases)


def drain(d: dict) -> tuple[str, Table]:
    auto, finish = d["auto"], d["finish"]
    head = (f"SIGTERM to a worker running {d['streams']} streams: it exits after {num(auto['worker_exit_s'], ' s')} "
            f"handing off vs {num(finish['worker_exit_s'], ' s')} finishing; {auto['completed']} completed, "
            f"{auto['lost']} lost")
    return head, faults(d, ["auto", "finish"])


def control_plane(d: dict) -> tuple[str, Table]:
    table = [["part", "workers", "step", "streams", "tok/s", "of the engines' limit", "added ITL p50 / p99", "cost"]]
    for f in d.get("fanout", []):
        table.append(["fan-out", str(f["workers"]), num(f["step_ms"], " ms"), num(f["streams"]),
                      num(f["output_tok_s"]), f"{f['output_tok_s'] / f['engine_limit_tok_s']:.0%}",
                      slash([num(f["added_itl_p50_ms"], " ms"), num(f["added_itl_p99_ms"], " ms")]),
                      f"gateway {num(f.get('gateway_cpu_share'))} of a core, "
                      f"{num(f.get('gateway_rss_idle_mb'), ' MB')} idle, "
                      f"{num(f.get('gateway_rss_peak_mb'), ' MB')} peak"])
    for row in d.get("scaling", {}).get("rows", []):
        table.append(["scaling", str(row["workers"]), num(d["scaling"]["step_ms"], " ms"), str(row["streams"]),
                      num(row["output_tok_s"]), f"{row['of_linear']:.0%} of linear", "-",
                      f"scheduler {num(row['scheduler_cpu_s_per_1000_requests'], ' CPU-s')} per 1,000 requests "
                      f"({pct(row['scheduler_cpu_share'], 1)} of a core)"])
    fan = d.get("fanout", [])
    rows = d.get("scaling", {}).get("rows", [])
    top, added = max(f["output_tok_s"] for f in fan), max(f["added_itl_p50_ms"] for f in fan)
    head = (f"{num(fan[0]['streams'])} SSE streams through one gateway: up to {num(top)} tok/s, added ITL p50 at "
            f"most {num(added, ' ms')}; "
            f"{slash([str(r['workers']) for r in rows])} workers at {slash([pct(r['of_linear']) for r in rows])} "
            "of linear")
    return head, table


def telemetry_overhead(d: dict) -> tuple[str, Table]:
    table = [["figure", "value"], ["tok/s traced", num(d["traced_tok_s_median"])],
             ["tok/s untraced (`TRACE_TTL=0`)", num(d["untraced_tok_s_median"])],
             ["metric updates per delivered token", num(d["metrics_cost_per_token_us"], " us")],
             ["their share of one core at the traced rate", f"{d['metrics_share_of_cpu_at_traced_rate']:.2%}"]]
    head = (f"tracing on / off: {num(d['traced_tok_s_median'])} / {num(d['untraced_tok_s_median'])} tok/s; metrics "
            f"{num(d['metrics_cost_per_token_us'], ' us')} per token")
    return head, table


def levels_table(d: dict, columns: list[tuple[str, str, Callable[[float], str]]]) -> Table:
    table = [["rows", *[label for _, label, _ in columns]]]
    for level in d["levels"]:
        table.append([str(level["rows"]), *[fmt(level[key]) for key, _, fmt in columns]])
    return table


def decode_step(d: dict) -> tuple[str, Table]:
    table = levels_table(d, [("step_ms", "step", lambda v: num(v, " ms")),
                             ("int8_kernel_ms", "fbgemm's int8 calls", lambda v: num(v, " ms")),
                             ("kernel_share", "their share", num), ("tokens_per_s", "tok/s", num),
                             ("kv_cache_bytes", "keys and values read", lambda v: num(v / 1e6, " MB")),
                             ("floor_ms", "bandwidth floor", lambda v: num(v, " ms"))])
    table.append(["", f"int8 weights {num(d['int8_weight_bytes'] / 1e6, ' MB')}",
                  f"read bandwidth {num(d['read_bandwidth_bytes_per_s'] / 1e9, ' GB/s')}", "", "", "", ""])
    levels = d["levels"]
    head = (f"int8 decode step at {slash([str(v['rows']) for v in levels])} rows, {d['setup']['context']} tokens "
            f"of context: {slash([num(v['step_ms']) for v in levels])} ms, fbgemm's share "
            f"{slash([num(v['kernel_share']) for v in levels])}")
    return head, table


def speedups(d: dict, slow: str, fast: str, what: str, extra: list[tuple[str, str, Callable[[float], str]]]) -> \
        tuple[str, Table]:
    table = levels_table(d, [(slow, slow.removesuffix("_ms"), lambda v: num(v, " ms")),
                             (fast, fast.removesuffix("_ms"), lambda v: num(v, " ms")),
                             ("speedup", "speed-up", ratio), *extra])
    levels = d["levels"]
    head = (f"{what} at {slash([str(v['rows']) for v in levels])} rows: "
            f"**{slash([ratio(v['speedup']) for v in levels])}**")
    return head, table


def native(d: dict) -> tuple[str, Table]:
    head, table = speedups(d, "scripted_ms", "native_ms", "the compiled kernels over TorchScript's layer",
                           [("min_cosine", "logits' cosine, min", lambda v: f"{v:.4f}"),
                            ("same_token_share", "same token", lambda v: f"{v:.0%}")])
    if "calls" in d:
        c = d["calls"]
        table.append(["", "one call: packed object " + num(c["fbgemm_op_packed_object_us"], " us"),
                      "by number " + num(c["native_number_torch_ops_us"], " us"),
                      "its C++ function " + num(c["native_number_function_us"], " us"), "", ""])
    return head, table


def scripted(d: dict) -> tuple[str, Table]:
    return speedups(d, "eager_ms", "scripted_ms", "the int8 layer as TorchScript over eager",
                    [("same_logits", "same logits", lambda v: "yes" if v else "no")])


def blocks(d: dict) -> tuple[str, Table]:
    head, table = speedups(d, "int8_ms", "gguf_ms", "the GGUF blocks over the int8 layers",
                           [("same_token_share", "same token", lambda v: f"{v:.0%}")])
    w = d["weight_bytes"]
    table.append(["", "weights read per step: int8 " + num(w["int8"] / 1e6, " MB"), "GGUF " +
                  num(w["gguf"] / 1e6, " MB"), "", ""])
    return head, table


def five_bit(d: dict) -> tuple[str, Table]:
    table = [["file", "rows", "Q5_1 blocks ms", "as Q8_0 ms", "speedup", "weights read MB Q5_1 / Q8_0"]]
    heads = []
    for name, f in d["files"].items():
        w = f["weight_bytes"]
        for level in f["levels"]:
            table.append([name, str(level["rows"]), num(level["q5_1_ms"]), num(level["q8_0_ms"]),
                          ratio(level["speedup"]), slash([num(w["q5_1"] / 1e6), num(w["q8_0"] / 1e6)])])
        heads.append(f"{name} **{slash([ratio(level['speedup']) for level in f['levels']])}**")
    rows = slash([str(level["rows"]) for level in next(iter(d["files"].values()))["levels"]])
    return f"the decode step on Q5_1 blocks over the same matrices as Q8_0 at {rows} rows: " + "; ".join(heads), table


def perplexity(d: dict) -> tuple[str, Table]:
    ppl, over = d["perplexity"], d["over_float32"]
    table = [["weights", "perplexity (second halves)", "over float32", "mean KL from float32", "same top token"]]
    for name, value in ppl.items():
        other = name if name in over else None
        table.append([name, f"{value['second_half']:.2f}", f"{over[other]['second_half'] - 1:+.1%}" if other else "",
                      num(d["second_half_mean_kl_divergence"][other]) if other else "",
                      f"{d['second_half_same_top_token'][other]:.1%}" if other else ""])
    if "llama_perplexity" in d:
        table.append(["`llama-perplexity`", f"{d['llama_perplexity']['second_half']:.2f}",
                      f"{over['llama_perplexity']['second_half'] - 1:+.1%}", "", ""])
    named = [(name, f"{over[name]['second_half'] - 1:+.1%}") for name in ("gguf", "int8", "llama_perplexity")
             if name in over]
    head = (f"{d['setup']['windows']} windows of {d['setup']['window']} tokens: float32 "
            f"{ppl['float32']['second_half']:.2f}; " + ", ".join(f"{name} {change}" for name, change in named))
    return head, table


def worker_start(d: dict) -> tuple[str, Table]:
    table = [["figure", "median"], ["process start to its first token", num(d["median_to_first_token_s"], " s")],
             ["resident memory after its first token", num(d["median_rss_after_first_token_mb"], " MB")],
             ["after 16 x 64 tokens", num(d["median_rss_after_16x64_mb"], " MB")]]
    head = (f"a worker's start to its first token {num(d['median_to_first_token_s'], ' s')}; "
            f"{num(d['median_rss_after_first_token_mb'], ' MB')} resident")
    return head, table


def worker_memory(d: dict) -> tuple[str, Table]:
    files = d["files"]
    stages = [row["stage"].split(" (")[0] for row in next(iter(files.values()))["stages"]]
    table = [["stage", *files]]
    for i, stage in enumerate(stages):
        table.append([stage, *(f"{num(f['stages'][i]['rss'])} ({num(f['stages'][i]['peak'])})"
                               for f in files.values())])
    shipped = files.get("shipped", next(iter(files.values())))["stages"]
    runtime = next(row["rss"] for row in shipped if row["stage"] == "engine modules")
    return f"{num(runtime, ' MB')} resident before any model (Python, torch, transformers' model code)", table


def isolation(d: dict) -> tuple[str, Table]:
    fair = d["fairness"]
    table = [["figure", "value"]]
    for case in ("no flood", "fair", "fifo"):
        table.append([f"a light key's TTFT p50, {case}", ms(fair[case]["light_ttft_s"]["p50"])])
    for r in d.get("memory", {}).get("rounds", []):
        table.append([f"Redis bytes left per finished request, `TRACE_TTL={r['trace_ttl']}`",
                      num(r["left_per_request_bytes"], " B")])
    slow = d.get("slow_readers")
    if slow:
        table += [[f"gateway RSS idle / peak, {num(slow['readers'])} clients that never read",
                   slash([num(slow["idle_rss_mb"], " MB"), num(slow["peak_rss_mb"], " MB")])],
                  ["a normal request meanwhile",
                   f"{slow['normal_request'][0]} in {num(slow['normal_request'][1], ' s')}"],
                  ["services that exited meanwhile", str(len(slow["services_exited"]))]]
    p50 = {case: ms(fair[case]["light_ttft_s"]["p50"]) for case in ("no flood", "fair", "fifo")}
    head = (f"a light key's TTFT p50 under a {fair['flooders']}-request flood: {p50['fair']} fair vs {p50['fifo']} "
            f"fifo ({p50['no flood']} alone)")
    return head, table


def resume(d: dict) -> tuple[str, Table]:
    table = [["scenario", "streams", "breaks", "tokens lost", "duplicated", "texts equal", "gap p50 / p99"]]
    for case, label in (("drop", "connection dropped"), ("kill", "gateway killed")):
        f = d[case]
        table.append([label, str(f["streams"]), str(f["breaks"]), str(f["tokens_lost"]), str(f["tokens_duplicated"]),
                      str(f["texts_equal_to_unbroken"]), slash([ms(f["gap_s_median"]), ms(f["gap_s_p99"])])])
    drop, kill = d["drop"], d["kill"]
    head = (f"{drop['breaks']} dropped connections and {kill['breaks']} gateway kills: "
            f"{drop['tokens_lost'] + kill['tokens_lost']} tokens lost, "
            f"{drop['tokens_duplicated'] + kill['tokens_duplicated']} duplicated; gap p50 "
            f"{ms(drop['gap_s_median'])} / {ms(kill['gap_s_median'])}")
    return head, table


def nemesis(d: dict) -> tuple[str, Table]:
    v, c, t = d["verdicts"], d["counts"], d["fault_to_next_token_s"]["all_faults"]
    head = (f"{d['minutes']:g} min of {sum(d['faults_struck'].values())} faults of {len(d['faults_struck'])} kinds, "
            f"{d['clients']} clients, ENGINE={d['engine']}: {c['jobs_completed']} of {c['jobs']} streams whole; "
            f"{v['duplicated']} duplicated, {v['lost']} lost, {v['run_twice']} run twice "
            f"({c.get('run_twice_by_a_woken_worker', 0)} by a woken frozen worker)")
    unexplained = d.get("verdicts_unexplained", {})
    table = [["verdict", "count", "not explained by the open failover fault"]] + [
        [name.replace("_", " "), str(value), str(unexplained.get(name, "-"))] for name, value in v.items()
        if name != "ok"]
    table.append(["fault to next token p50 / p90 / max", slash([ms(t["median"]), ms(t["p90"]), ms(t["max"])]), ""])
    return head, table


def request_controls(d: dict) -> tuple[str, Table]:
    i, p, q = d["idempotency"], d["priorities"], d["quotas"]
    table = [["target", "measured"],
             [f"{i['clients']} clients that drop their stream and retry it with the same Idempotency-Key: "
              f"{i['clients']} requests run, not {2 * i['clients']}",
              f"{i['requests_admitted']} admitted, {i['distinct_request_ids']} request ids, {i['texts_whole']} "
              "texts whole and equal to the answer without a key"],
             [f"priority 0 TTFT p50 at most a third of priority 10's ({p['streams']['0']} and {p['streams']['10']} "
              f"streams on {p['slots']} slots)",
              f"{ms(p['ttft_p50_s']['0'])} against {ms(p['ttft_p50_s']['10'])} ({ratio(p['ratio_0_over_10'])})"]]
    quotas = [(t, f"{q['rpm']} requests a minute", "") for t in q["trials"]] + [
        (t, f"{q['tpm']} tokens a minute ({q['max_tokens']}-token requests, no request limit)",
         f" once its minute's answers held {t.get('tokens_in_the_refusing_minute')} tokens")
        for t in q.get("tpm_trials", [])]
    for t, allowed, spent in quotas:
        refused_by = f", refused by gateway {t['refused_by_gateway']}{spent}" if "refused_by_gateway" in t else ""
        table.append([f"`{t['key']}` at {allowed}, on two gateways: Retry-After within 5% of the minute of the "
                      "true reset", f"{t['retry_after_s']} s against {t['true_reset_s']:.2f} s "
                      f"({t['error_share_of_minute']:.1%} of the minute){refused_by}; let through after it: "
                      f"{t['let_through_after']}"])
    worst = max(t["error_share_of_minute"] for t, _, _ in quotas)
    head = (f"idempotent retries: {i['requests_admitted']} of {i['clients']} run; priority 0 TTFT "
            f"{ratio(p['ratio_0_over_10'])} of priority 10's; Retry-After of {len(quotas)} requests- and "
            f"tokens-per-minute refusals at most {worst:.1%} of a minute off")
    return head, table


def sentinel_writes(d: dict) -> tuple[str, Table]:
    table = [["replicas", "min-replicas-to-write", "writes acknowledged", "lost (acknowledged, then gone)",
              "longest pause between two writes"]]
    table += [[str(g["replicas"]), str(g["min_replicas_to_write"]), f"{g['acknowledged']:,}", f"{g['lost']:,}",
               num(g["longest_pause_s"], " s")] for g in d["groups"]]
    head = "acknowledged writes lost through a `SENTINEL FAILOVER`, by replicas / min-replicas-to-write: " + "; ".join(
        f"{g['replicas']} / {g['min_replicas_to_write']}: {g['lost']:,} of {g['acknowledged']:,} (longest pause "
        f"{num(g['longest_pause_s'], ' s')})" for g in d["groups"])
    return head, table


def batch_lane(d: dict) -> tuple[str, Table]:
    alone, beside = d["interactive_alone"], d["interactive_beside_batch"]
    head = (f"a {d['lines']}-line batch job beside {d['streams']} interactive streams: TTFT p50 "
            f"{ratio(d['ttft_ratio'])} of the streams alone, the job {ratio(d['batch_time_ratio'])} the time the "
            "free slots allow")
    rounds = d.get("interleaved")
    if rounds:
        head += (f"; in alternating windows, TTFT p50 beside a job {ratio(rounds['ttft_ratio_median'])} of alone "
                 f"(median of {len(rounds['rounds'])} rounds, {ratio(rounds['ttft_ratio_min'])} to "
                 f"{ratio(rounds['ttft_ratio_max'])})")
    if d.get("other_runs"):
        ratios = ", ".join(f"{ratio(r['ttft_ratio'])} / {ratio(r['batch_time_ratio'])} ({r['label']})"
                           for r in d["other_runs"])
        head += f"; other runs, TTFT / job: {ratios}"
    table = [["phase", "interactive TTFT p50", "interactive time per token p50", "job time"],
             ["interactive alone", ms(alone["ttft_p50_s"]), ms(alone["itl_p50_s"]), "-"],
             ["the job alone", "-", "-", num(d["batch_alone"]["seconds"], " s")],
             ["both", ms(beside["ttft_p50_s"]), ms(beside["itl_p50_s"]),
              f"{num(d['batch_beside_interactive']['seconds'], ' s')} (allowed {num(d['batch_allowed_s'], ' s')})"]]
    if rounds:
        def median_of(phase: str, key: str) -> float:
            return statistics.median(r[phase][key] for r in rounds["rounds"])
        table.append([f"alternating: {rounds['window_s']:.0f} s alone, then a {rounds['lines_per_round']}-line job, "
                      f"{len(rounds['rounds'])} rounds (medians)",
                      f"{ms(median_of('alone', 'ttft_p50_s'))} alone, {ms(median_of('beside', 'ttft_p50_s'))} beside",
                      f"{ms(median_of('alone', 'itl_p50_s'))} / {ms(median_of('beside', 'itl_p50_s'))}",
                      num(statistics.median(r["job"]["seconds"] for r in rounds["rounds"]), " s")])
    if "faults" in d:
        f = d["faults"]
        table.append([f"kill -9 of {', '.join(s['killed'] for s in f['struck'])} mid-job", "-", "-",
                      f"{num(f['seconds'], ' s')}: {f['request_counts']['completed']} of {f['request_counts']['total']}"
                      f" answered, once each: {f['answered_once']}"])
    return head, table


def cluster(d: dict) -> tuple[str, Table]:
    m = d["stack"]["median"]
    table = [["figure", "one redis-server", "cluster of three masters"],
             ["tok/s", num(m["single"]["output_tok_s"]), num(m["cluster"]["output_tok_s"])],
             ["ITL p50 / p99", slash([num(m["single"]["itl_p50_ms"]), num(m["single"]["itl_p99_ms"])]) + " ms",
              slash([num(m["cluster"]["itl_p50_ms"]), num(m["cluster"]["itl_p99_ms"])]) + " ms"]]
    for rows in d["publish_ms"]["single"]:
        table.append([f"a worker step's publish of {rows} rows (one script call vs one per request's slot)",
                      num(d["publish_ms"]["single"][rows], " ms"),
                      num(d["publish_ms"]["cluster"][rows], " ms")])
    table.append(["admitting a stream (its log created first, in its own slot)", num(d["admit_ms"]["single"], " ms"),
                  num(d["admit_ms"]["cluster"], " ms")])
    head = (f"`ENGINE=sim` on one redis-server vs a three-master cluster: {num(m['single']['output_tok_s'])} vs "
            f"{num(m['cluster']['output_tok_s'])} tok/s ({ratio(m['cluster_over_single'])})")
    return head, table


def grammar(d: dict) -> tuple[str, Table]:
    table = [["figure", "value"]]
    for batch, f in d["mask_cost"].items():
        table.append([f"the grammar's cost in a decode step, batch {batch}",
                      f"{num(f['grammar_ms'], ' ms')} ({f['grammar_share_of_step']:.1%} of the step)"])
    valid = d["valid_rate"]
    held = sum(v["constrained"] for v in valid.values()) / len(valid)
    free = sum(v["unconstrained"] for v in valid.values()) / len(valid)
    table.append([f"schema-valid answers to questions asking for JSON of {len(valid)} schemas, constrained / free",
                  f"{held:.0%} / {free:.0%}"])
    for name, f in d.get("libraries", {}).items():
        table.append([f"{name}: matcher build; mask per token p50",
                      f"{num(f['build_ms'], ' ms')}; {num(f['mask_us_p50'], ' us')}"])
    costs = d["mask_cost"]
    head = (f"the grammar's share of a decode step at batch {slash(list(costs))}: "
            f"{slash([pct(f['grammar_share_of_step'], 1) for f in costs.values()])}; schema-valid {held:.0%} "
            f"constrained, {free:.0%} free")
    return head, table


def hostile(d: dict) -> tuple[str, Table]:
    table = [["run", "at", "grammar chains answered (rules: status)", "gateway survived",
              "resumers whole (of 1 / 3 / 200)"]]
    for label, r in d.items():
        if not isinstance(r, dict) or "grammars" not in r:
            continue
        g = r["grammars"]
        chains = ", ".join(f"{row['rules']}: {row['status']}" for row in g["one_at_a_time"])
        table.append([label, str(r.get("stack_commit", r["provenance"].get("commit", "")))[:7], chains,
                      "yes" if g["gateway_survived"] else "no",
                      slash([str(row["whole"]) for row in r["resumers"]])])
    latest = d.get("after") or next(v for v in d.values() if isinstance(v, dict) and "grammars" in v)
    head = (f"hostile grammars and many resumers: gateway survived "
            f"{'yes' if latest['grammars']['gateway_survived'] else 'no'}; resumers whole "
            f"{slash([str(row['whole']) + ' of ' + str(row['readers']) for row in latest['resumers']])}")
    return head, table


def models(d: dict) -> tuple[str, Table]:
    table = [["figure", "value"]]
    for label, r in d.get("mix", {}).items():
        table.append([f"two-model mix, {label} ({r.get('stack_commit', '')[:7]}): answers from another model's "
                      "worker", f"{r['wrong_model_answers']} of {r['requests']}"])
    dispatch = d.get("dispatch")
    if dispatch:
        for name, f in dispatch["medians"].items():
            table.append([f"`ENGINE=sim` dispatch, {name}: tok/s, TTFT p50, scheduler CPU s / 1,000 requests",
                          f"{num(f['output_tok_s'])}, {num(f['ttft_p50_ms'], ' ms')}, "
                          f"{num(f['scheduler_cpu_s_per_1000_requests'])}"])
    after = d.get("mix", {}).get("after")
    head = (f"{after['wrong_model_answers']} of {after['requests']} answers from another model's worker"
            if after else "several models")
    if dispatch:
        head += f"; two models dispatch at {ratio(dispatch['two_over_one']['output_tok_s'])} one model's tok/s"
    return head, table


def cuda_stack(d: dict) -> tuple[str, Table]:
    levels = d["levels"]
    table = [["concurrency", "output tok/s", "TTFT p50", "ITL p50", "ITL p99", "failed"]]
    for level in levels:
        table.append([str(level["concurrency"]), num(level["output_tok_s"]), ms(level["ttft_s"]["p50"]),
                      ms(level["itl_s"]["p50"]), ms(level["itl_s"]["p99"]), str(level["failed"])])
    head = (f"output tok/s at concurrency {slash([str(level['concurrency']) for level in levels])}: "
            f"{slash([num(level['output_tok_s']) for level in levels])}, "
            f"{sum(level['failed'] for level in levels)} failed")
    return head, table


def cuda_decode(d: dict) -> tuple[str, Table]:
    levels = d["levels"]
    table = [["rows", "engine step p50", "forward p50", "tok/s"]]
    for level in levels:
        table.append([str(level["rows"]), num(level["step_ms_p50"], " ms"), num(level["forward_ms_p50"], " ms"),
                      num(level["step_tok_s"])])
    head = (f"decode step at {slash([str(level['rows']) for level in levels])} rows: "
            f"{slash([num(level['step_ms_p50']) for level in levels])} ms")
    return head, table


def cuda_correctness(d: dict) -> tuple[str, Table]:
    pairs = [key[:-len("_identical")] for key in d if key.endswith("_identical")]
    table = [["pair", "completions identical", "positions agreeing"]]
    for pair in pairs:
        table.append([pair.replace("~", " vs "), str(d[f"{pair}_identical"]),
                      pct(d[f"{pair}_positions_agreeing_share"], 1)])
    alone = "engine_alone~hf_alone"
    head = (f"greedy, the engine alone against HF `generate` alone: {d[f'{alone}_identical']} completions identical; "
            f"largest top-logit lead where two parted {num(d['largest_divergence_gap'])}")
    return head, table


def cuda_attention(d: dict) -> tuple[str, Table]:
    rows = list(d["off_over_on"])
    table = [["turn", *[f"step p50, {r} rows" for r in rows]]]
    for turn in d["turns"]:
        table.append([f"cuDNN attention {'on' if turn['cudnn_attention'] else 'off'}",
                      *[num(turn["step_ms_p50"][r], " ms") for r in rows]])
    head = (f"decode step at {slash(rows)} rows, cuDNN's attention on over off (the default): "
            f"**{slash([ratio(d['off_over_on'][r]) for r in rows])}**")
    return head, table


def generic(d: dict) -> tuple[str, Table]:
    """A benchmark this script has no renderer for: its top-level figures."""
    rows = [[key, num(value)] for key, value in d.items()
            if isinstance(value, int | float) and not isinstance(value, bool)]
    return "figures in its results file", [["figure", "value"], *rows[:12]]


RENDERERS: dict[str, tuple[str, Callable[[dict], tuple[str, Table]]]] = {
    "peers": ("llmserve against llama.cpp's server (`-t 2`; `--parallel` and `-c` as the setup's llama_server_slots "
              "and llama_server_context, else 16 and 8192) on the same GGUF file, greedy, the servers taking turns for "
              "several rounds, each level's median round", peers),
    "peers_avx2_paths": ("the same with both sides on their AVX2 code paths, the AVX2-only hosts' kernels on an "
                         "AVX-512 host (`WORKER_ISA=avx2`, `ATEN_CPU_CAPABILITY=avx2`; llama-server built without "
                         "AVX-512)", peers),
    "peers_prompt64": ("the same with 64-token prompts (`--prompt-tokens 64`), issue 29's own workload", peers),
    "vllm_peers": ("the stack with `ENGINE=vllm` against vLLM's own OpenAI server on the same model and engine "
                   "arguments, the own engine beside them", vllm_peers),
    "user_models": ("llmserve against llama-server (`-t 2 --parallel 16`, 512 tokens of context a slot) on the "
                    "files users download: the default model requantized by llama-quantize, and random weights in "
                    "public models' shapes made offline (`bench/user_models.py make`); 12-token prompts, 64 forced "
                    "tokens", user_models),
    "user_models_long": ("time to first token of ~900-token prompts distinct from their first token: eight at c = 1, "
                         "eight others at c = 4, then those eight again at c = 4; llmserve with its default prefix "
                         "cache (`PREFIX_CACHE_BYTES=auto`) and the former default's 256 MiB, and llama-server "
                         "(`--parallel 4`, 2048 tokens a slot)", user_models_long),
    "prefix_cache": ("time to first token with a shared ~1,000-token prefix, the prefix cache on and off",
                     prefix_cache),
    "chunked_prefill": ("inter-token latency of running streams while long prompts arrive (the target: a p99 at most "
                        "2x the p99 with no arrivals)", chunked_prefill),
    "sampling": ("sampled against greedy requests through one worker", sampling),
    "stack_throughput": ("the whole stack against an in-process `generate` and the seed's design",
                         stack_throughput),
    "quality": ("int8 against float32: speed, answers, batch invariance", quality),
    "perplexity": ("perplexity of the GGUF blocks and int8 against float32 (and llama.cpp)", perplexity),
    "perplexity_smollm2_135m_q4_k_m": ("the same for the default model requantized to Q4_K_M by llama-quantize "
                                       "(Q4_K, Q5_0 and Q6_K: the blocks taken to Q4_1, Q5_1 and Q8_0), its own "
                                       "float32 as the reference", perplexity),
    "perplexity_smollm2_135m_q5_k_m": ("the same requantized to Q5_K_M (Q5_K, Q5_1 and Q6_K: the blocks taken to Q5_1 "
                                       "and Q8_0)", perplexity),
    "perplexity_smollm2_135m_q6_k": ("the same requantized to Q6_K (and Q8_0 where a row is no multiple of 256)",
                                     perplexity),
    "worker_start": ("a new worker: process start to its first token served (model load and weight packing "
                     "included), its memory", worker_start),
    "decode_step": ("where an int8 decode step's time goes", decode_step),
    "decode_step_ctx500": ("the same at 500 tokens of context", decode_step),
    "native": ("the decode step with and without worker/weights/native.cpp's kernels, taking turns", native),
    "scripted": ("the int8 decode step eager and as TorchScript, taking turns", scripted),
    "blocks": ("the decode step on the GGUF file's own blocks against the int8 layers, taking turns", blocks),
    "five_bit": ("the decode step of files whose matrices are 5-bit on the Q5_1 blocks against the same matrices "
                 "quantized again to Q8_0 (the loader before the Q5_1 blocks), taking turns", five_bit),
    "batching_hf": ("continuous against static batching, Poisson arrivals, the real model", batching),
    "batching_sim": ("continuous against static batching on `ENGINE=sim` workers", batching),
    "control_plane": ("`ENGINE=sim`: 1,000 SSE streams through one gateway; 1 to 8 workers", control_plane),
    "cluster": ("`ENGINE=sim` on one redis-server against a Redis Cluster of three masters on the same cores, taking "
                "turns (on one machine the cluster only adds client work; its gain is Redis spread over machines)",
                cluster),
    "burst": ("a burst of 4x the queue limit", burst),
    "chaos": ("each fault with streams in flight", chaos),
    "nemesis": ("faults together under a steady load: workers, gateways and the scheduler killed (-9 and SIGTERM), a "
                "worker frozen past its TTL, Sentinel failovers and a killed primary, clients that vanish, a worker's "
                "traffic to Redis delayed and cut off; then a checker over every request's history "
                "(bench/nemesis.py)", nemesis),
    "nemesis-hf": ("the same on the real model (`--engine hf`: 4 clients, 32 tokens a stream)", nemesis),
    "request_controls": ("retries with an Idempotency-Key, priorities and per-key quotas on one worker of the "
                         "default model behind two gateways (bench/request_controls.py)", request_controls),
    "sentinel_writes": ("one client appending through a `SENTINEL FAILOVER`: the writes it was told succeeded and "
                        "then lost, by how the Redis group runs (bench/sentinel_writes.py)", sentinel_writes),
    "batch_lane": ("a batch job in the background lane beside interactive streams, on one worker of the default "
                   "model (bench/batch_lane.py). The time the job is allowed is what the slots the interactive "
                   "streams leave free take to run its lines: lines / (slots - interactive streams) x tokens a line "
                   "x the step time, the step time being the interactive streams' time per token (p50) while the "
                   "job runs; the target is a job time of at most 1.2x that", batch_lane),
    "drain_hf": ("SIGTERM to a worker: handing off against finishing in place", drain),
    "drain_sim": ("the same on `ENGINE=sim`", drain),
    "resume_sim": ("resuming after a dropped connection or a killed gateway, `ENGINE=sim`", resume),
    "resume_hf": ("the same on the real model, greedy", resume),
    "worker_memory": ("where an own-engine worker's memory goes: resident MB after each stage of its start (its peak "
                      "so far), a fresh process per file (`bench/worker_memory.py`)", worker_memory),
    "isolation": ("`ENGINE=sim`, one worker of 16 slots: fair shares against fifo, Redis bytes left per finished "
                  "request, 1,000 clients that never read", isolation),
    "telemetry_overhead": ("tracing on and off; what metrics cost per token", telemetry_overhead),
    "grammar": ("structured outputs: the grammar's cost per step, schema-valid rates, grammar libraries", grammar),
    "hostile": ("hostile grammars and many clients resuming one stream, against a running stack", hostile),
    "models": ("several models behind one gateway", models),
    "cuda_stack": ("the own engine on one GPU (`ENGINE=hf`, bfloat16, `WORKER_QUANT=none`) through the whole stack, "
                   "64 new tokens, greedy (`bench/cuda.sh`)", cuda_stack),
    "cuda_attention": ("the same engine's decode step with cuDNN's attention off (the default) and on, taking turns",
                       cuda_attention),
    "cuda_decode": ("the same engine's decode step alone on the GPU, 64 tokens of context", cuda_decode),
    "cuda_correctness": ("the same engine's greedy completions against HF `generate` on the GPU, alone and in "
                         "batches (bfloat16 parts batched from alone at near ties)", cuda_correctness),
}
ORDER = list(RENDERERS)


def load(results: Path = RESULTS) -> list[Run]:
    runs = [Run(path, json.loads(path.read_text())) for path in sorted(results.glob("*.json"))]
    rank, kinds = {name: i for i, name in enumerate(ORDER)}, list(KIND_NAMES)
    return sorted(runs, key=lambda run: (rank.get(run.benchmark, len(rank)), run.benchmark,
                                         kinds.index(run.kind) if run.kind in kinds else len(kinds), run.kind))


def render(run: Run) -> tuple[str, Table]:
    _, renderer = RENDERERS.get(run.benchmark, ("", generic))
    return renderer(run.data)


def markdown(table: Table) -> str:
    lines = ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in table[1:]])


def readme_tables(runs: list[Run]) -> str:
    parts = []
    for kind in README_KINDS:
        rows = [run for run in runs if run.kind == kind]
        if not rows:
            continue
        parts.append(f"**{KIND_NAMES[kind]}** (`{kind}`)\n\n| benchmark | figures | command | commit | "
                     "date |\n|---|---|---|---|---|\n"
                     + "\n".join(f"| {run.benchmark} | {render(run)[0]} | {run.source()} |" for run in rows))
    return "\n\n".join(parts)


def setup(data: dict) -> str:
    """A run's setup in a line: its plain values (not paths, not nested settings)."""
    plain = {key: value for key, value in (data.get("setup") or {}).items()
             if isinstance(value, int | float | bool | str | list) and "/" not in str(value)}
    return ("; setup: " + ", ".join(f"{key} {value}" for key, value in plain.items())) if plain else ""


def docs_tables(runs: list[Run]) -> str:
    parts = []
    for name in dict.fromkeys(run.benchmark for run in runs):
        what = RENDERERS.get(name, ("",))[0]
        parts.append(f"### {name}" + (f": {what}" if what else ""))
        for run in (r for r in runs if r.benchmark == name):
            p = run.provenance
            host = ", ".join(str(x) for x in (p.get("cpu"), f"{p.get('cores')} cores" if p.get("cores") else None,
                                              p.get("gpu")) if x and x != "not recorded")
            plot = run.path.with_suffix(".png")
            parts.append(f"**{KIND_NAMES.get(run.kind, run.kind)}**{f' ({host})' if host else ''}: "
                         f"`{p.get('command', '?')}`, commit {str(p.get('commit', '?'))[:7]}, "
                         f"{str(p.get('at', '?'))[:10]}, `bench/results/{run.path.name}`"
                         + (f" ([plot](../bench/results/{plot.name}))" if plot.exists() else "")
                         + setup(run.data) + "\n\n" + markdown(render(run)[1]))
    return "\n\n".join(parts)


TARGETS: dict[str, Callable[[list[Run]], str]] = {"README.md": readme_tables, "docs/benchmarks.md": docs_tables}


def spliced(text: str, tables: str, name: str) -> str:
    """`text` with what lies between its markers replaced by `tables`."""
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"{name}: needs one {BEGIN} and one {END}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{tables}\n{END}{tail}"


def stale(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """The documents whose tables differ from what the results render."""
    runs = load(results)
    return [name for name, build in TARGETS.items()
            if (root / name).read_text() != spliced((root / name).read_text(), build(runs), name)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is out of date")
    args = parser.parse_args()
    if args.check:
        out_of_date = stale()
        for name in out_of_date:
            print(f"{name}: its benchmark tables differ from bench/results; run python bench/tables.py")
        sys.exit(1 if out_of_date else 0)
    runs = load()
    for name, build in TARGETS.items():
        path = ROOT / name
        path.write_text(spliced(path.read_text(), build(runs), name))
        print(f"wrote {name}")


if __name__ == "__main__":
    main()
