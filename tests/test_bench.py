"""`llmserve bench`: its workload, its statistics, its SSE reading, and a real run against the stack."""

from __future__ import annotations

import itertools
import json
import random
import statistics
import subprocess
import sys

import pytest

from llmserve.loadgen.client import Outcome, _Reader
from llmserve.loadgen.stats import percentile, summarize
from llmserve.loadgen.workload import Lengths, arrival_offsets, make_jobs
from llmserve.processes import free_port


def test_lengths_parse_and_draw_within_their_distribution() -> None:
    rng = random.Random(0)
    assert Lengths.parse("64").draw(rng) == 64
    uniform = [Lengths.parse("uniform:16:256").draw(rng) for _ in range(500)]
    assert min(uniform) >= 16 and max(uniform) <= 256 and len(set(uniform)) > 100
    normal = [Lengths.parse("normal:100:10").draw(rng) for _ in range(2000)]
    assert abs(statistics.mean(normal) - 100) < 2 and 8 < statistics.stdev(normal) < 12
    assert Lengths.parse("normal:1:50").draw(random.Random(1)) >= 1
    for bad in ("abc", "poisson:1:2", "uniform:3"):
        with pytest.raises(ValueError, match=r"expected|unknown"):
            Lengths.parse(bad)


def test_jobs_are_distinct_reproducible_and_sized() -> None:
    jobs = make_jobs(50, Lengths("fixed", 20), Lengths("uniform", 5, 9), seed=7)
    assert len({job.prompt for job in jobs}) == 50
    assert all(len(job.prompt.split()) == 19 for job in jobs)  # the "n." opening counts as a word
    assert {job.max_tokens for job in jobs} <= set(range(5, 10))
    assert jobs == make_jobs(50, Lengths("fixed", 20), Lengths("uniform", 5, 9), seed=7)
    assert jobs != make_jobs(50, Lengths("fixed", 20), Lengths("uniform", 5, 9), seed=8)


def test_poisson_arrivals_have_the_asked_rate() -> None:
    assert arrival_offsets(5, None, 0) == [0.0] * 5
    offsets = arrival_offsets(4000, 50.0, 0)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert all(gap >= 0 for gap in gaps)
    assert abs(statistics.mean(gaps) - 1 / 50) < 0.002
    assert abs(statistics.stdev(gaps) - 1 / 50) < 0.003  # exponential: the deviation equals the mean


def test_percentiles_and_summary_from_known_times() -> None:
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)
    first = Outcome(sent=0.0, token_times=[0.5, 0.6, 0.8], ended=0.9)
    second = Outcome(sent=1.0, token_times=[1.2, 1.3], ended=1.3, completion_tokens=2)
    failed = Outcome(sent=0.0, ended=0.1, error="HTTP 503: busy")
    summary = summarize([first, second, failed], duration=2.0)
    assert summary["requests"] == 3 and summary["failed"] == 1 and summary["errors"] == ["HTTP 503: busy"]
    assert summary["output_tokens"] == 5 and summary["output_tok_s"] == 2.5
    assert summary["ttft_s"]["mean"] == pytest.approx(0.35)
    assert summary["itl_s"]["p50"] == pytest.approx(0.1)
    assert summary["e2e_s"]["p50"] == pytest.approx(0.6)


def test_sse_reading_survives_events_split_across_chunks() -> None:
    openai = Outcome(sent=0.0)
    reader = _Reader("openai", openai)
    body = (b'data: {"choices":[{"text":"Hel"}]}\n\ndata: {"choices":[{"text":""}]}\n\n'
            b'data: {"choices":[{"text":"lo"}]}\r\n\r\ndata: {"choices":[],"usage":{"completion_tokens":3}}\n\n'
            b"data: [DONE]\n\n")
    for cut in range(0, len(body), 7):
        reader.feed(body[cut:cut + 7])
    assert len(openai.token_times) == 2 and openai.tokens == 3 and openai.error is None

    native = Outcome(sent=0.0)
    reader = _Reader("native", native)
    reader.feed(b'id: 0\ndata: {"token":"a","index":0}\n\nid: 1\ndata: {"tok')
    reader.feed(b'en":"b","index":1}\n\ndata: {"finish_reason":"length","completion_tokens":2}\n\n')
    assert len(native.token_times) == 2 and native.tokens == 2 and native.ok

    broken = Outcome(sent=0.0)
    _Reader("native", broken).feed(b'event: error\ndata: {"error":{"message":"lost","code":"x"}}\n\n')
    assert not broken.ok and "lost" in broken.error


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "llmserve.cli", "bench", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("api", ["native", "openai"])
def test_llmserve_bench_measures_the_real_stack(stack, tmp_path, api: str) -> None:
    out, plot = tmp_path / "result.json", tmp_path / "plot.png"
    run = bench("--url", stack.url, "--api", api, "--concurrency", "1,2", "--requests", "3", "--prompt-tokens", "6",
                "--output-tokens", "5", "--warmup", "1", "--out", str(out), "--plot", str(plot))
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    assert [level["concurrency"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert level["failed"] == 0 and level["output_tokens"] == 15
        assert 0 < level["ttft_s"]["p50"] <= level["e2e_s"]["p50"]
        assert level["itl_s"]["p50"] > 0 and level["output_tok_s"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "out tok/s" in run.stdout and "3/3 requests" in run.stderr


def test_llmserve_bench_reports_a_server_that_is_not_there() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run = bench("--url", url, "--api", "native", "--requests", "2", "--warmup", "0")
    assert run.returncode == 1 and "2 failed" in run.stderr
    assert "failed: ConnectionRefusedError" in run.stdout
    run = bench("--url", url)
    assert run.returncode != 0 and "pass --model" in run.stderr
    run = bench("--output-tokens", "lots")
    assert run.returncode == 2 and "expected N" in run.stderr
