"""Per-key quotas (KEY_RPM, KEY_TPM, `llmserve quota`) on a real redis-server, two real gateways, a scheduler and an
ENGINE=sim worker as processes, over real HTTP: a key's requests per minute are counted across both gateways and the
next one is a 429 with Retry-After to the minute's end; its tokens per minute count as its streams end, each token
once however many readers a stream has (dropped and resumed, replayed); another key is untouched; one key's own
quota, set from the command line while the stack runs, replaces the defaults."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from common.clients import sync_client
from common.keys import Keys
from gateway.middleware import tenant_of
from harness.stacks import PrivateStack
from tests.conftest import sim_stack
from tests.sse import read

NAMESPACE = "quota"
SETTINGS = {"API_KEYS": "alpha,beta,gamma,delta", "KEY_RPM": "3", "NAMESPACE": NAMESPACE, "SIM_STEP_MS": "5"}


@pytest.fixture(scope="module")
def sim() -> Iterator[PrivateStack]:
    with sim_stack(1, gateways=2, **SETTINGS) as running:
        yield running


def within_one_minute(sim: PrivateStack, needed_s: float = 15) -> None:
    """Wait, if need be, until Redis' minute has `needed_s` seconds left: a test's requests share one window."""
    seconds = int(sync_client(sim.redis_url).time()[0]) % 60
    if seconds > 60 - needed_s:
        time.sleep(61 - seconds)


def complete(url: str, key: str, tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": "sim", "prompt": "count me", "max_tokens": tokens, "ignore_eos": True})


def quota(sim: PrivateStack, *args: str) -> str:
    env = {**os.environ, "REDIS_URL": sim.redis_url, **SETTINGS}
    done = subprocess.run([sys.executable, "-m", "llmserve.cli", "quota", *args], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_requests_per_minute_are_counted_across_gateways(sim: PrivateStack) -> None:
    within_one_minute(sim)
    answers = [complete(sim.urls[i % 2], "alpha") for i in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert complete(sim.url, "beta").status_code == 200  # another key's window


def test_a_key_s_own_token_quota_replaces_the_defaults(sim: PrivateStack) -> None:
    shown = quota(sim, "gamma", "--rpm", "0", "--tpm", "50")
    assert "unlimited requests and 50 tokens per minute (its own)" in shown
    within_one_minute(sim)
    first = complete(sim.urls[0], "gamma", tokens=30)
    second = complete(sim.urls[1], "gamma", tokens=30)  # admitted: 30-odd tokens used of 50
    assert first.status_code == second.status_code == 200
    used = first.json()["usage"]["total_tokens"] + second.json()["usage"]["total_tokens"]
    assert f"{used} tokens" in quota(sim, "gamma")
    refused = complete(sim.url, "gamma")
    assert refused.status_code == 429 and "50 tokens" in refused.json()["error"]["message"]
    assert [complete(sim.url, "gamma").status_code for _ in range(2)] == [429, 429]  # no rpm of its own: tokens
    assert "3 requests" in quota(sim, "gamma", "--clear")  # back to KEY_RPM


def counted_tokens(sim: PrivateStack, key: str) -> int:
    """The tokens of `key`'s quota window this minute, as admission reads them."""
    used = sync_client(sim.redis_url).hget(Keys(NAMESPACE).quota(tenant_of(key.encode())), "t")
    return int(used or 0)


def test_a_dropped_and_resumed_stream_counts_its_tokens_once(sim: PrivateStack) -> None:
    within_one_minute(sim)
    delta = {"Authorization": "Bearer delta"}
    body = {"model": "sim", "prompt": "count me", "max_tokens": 40, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    broken = read(sim.urls[0], "/v1/completions", "POST", body, delta, upto=6)
    answer_id = broken.events[0].data["id"]
    resumed = {**delta, "Last-Event-ID": broken.events[-1].id}
    rest = read(sim.urls[1], f"/v1/requests/{answer_id}/stream", headers=resumed)
    assert rest.status == 200 and rest.events[-1].done
    usage = rest.events[-2].data["usage"]
    assert usage["completion_tokens"] == 40 and usage["prompt_tokens"] > 0
    # A third reader replays the whole stream: everything it sees was counted already.
    assert read(sim.urls[0], f"/v1/requests/{answer_id}/stream", headers=delta).events[-1].done
    deadline = time.monotonic() + 10
    while counted_tokens(sim, "delta") < usage["total_tokens"] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # every reader's count has landed by now
    assert counted_tokens(sim, "delta") == usage["total_tokens"]


def test_a_negative_quota_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.settings import Settings, SettingsError

    monkeypatch.setenv("KEY_TPM", "-5")
    with pytest.raises(SettingsError, match="KEY_TPM"):
        Settings.from_env()
