"""common/sandbox.py on its own: a job's answer, its refusal, and every way a child can be lost (a native
crash, a stack overflow, a job past its time, an allocation past its bound, an exit, a caller that leaves)
costs that one call; the next call, and the calls running beside it, get their own answers."""

from __future__ import annotations

import asyncio

import pytest

from common.sandbox import Failed, Limits, Refused, Sandbox

JOB = "tests.sandbox_jobs:act"
LIMITS = Limits(seconds=3.0, memory_bytes=1 << 30, stack_bytes=1 << 20)


def run(scenario) -> None:
    async def main() -> None:
        sandbox = Sandbox(JOB, 2, LIMITS)
        try:
            await scenario(sandbox)
        finally:
            await sandbox.close()

    asyncio.run(main())


def test_a_job_answers_and_a_job_that_raises_is_refused_with_its_message() -> None:
    async def scenario(sandbox: Sandbox) -> None:
        await sandbox.start()
        assert await sandbox.run("echo", {"a": [1, "two"]}) == {"a": [1, "two"]}
        with pytest.raises(Refused, match="refused this"):
            await sandbox.run("raise", "this")
        with pytest.raises(Refused, match="SystemExit"):
            await sandbox.run("exit")
        assert await sandbox.run("echo", "still here") == "still here"

    run(scenario)


@pytest.mark.parametrize(("what", "value", "why"), [
    ("segfault", None, "SIGSEGV"),
    ("overflow", 3000, "SIGSEGV"),  # the job thread's 1 MiB stack overflows
    ("sleep", 30, "ran past the sandbox's 3 s"),
    ("die", None, "exit status 3"),
])
def test_a_lost_child_fails_that_call_only_and_the_next_call_is_answered(what: str, value: object, why: str) -> None:
    async def scenario(sandbox: Sandbox) -> None:
        with pytest.raises(Failed, match=why):
            await sandbox.run(what, value)
        assert await sandbox.run("echo", 1) == 1

    run(scenario)


def test_an_allocation_past_the_bound_is_refused_or_fails_and_the_sandbox_goes_on() -> None:
    async def scenario(sandbox: Sandbox) -> None:
        with pytest.raises((Refused, Failed)):
            await sandbox.run("allocate", 4 << 30)
        assert await sandbox.run("allocate", 1 << 20) == 1 << 20

    run(scenario)


def test_calls_beside_a_crash_get_their_own_answers() -> None:
    async def scenario(sandbox: Sandbox) -> None:
        calls = [("segfault", None) if i % 3 == 0 else ("echo", i) for i in range(12)]
        answers = await asyncio.gather(*(sandbox.run(*call) for call in calls), return_exceptions=True)
        for i, answer in enumerate(answers):
            if i % 3 == 0:
                assert isinstance(answer, Failed)
            else:
                assert answer == i

    run(scenario)


def test_a_caller_that_leaves_mid_job_does_not_leave_its_answer_to_the_next() -> None:
    async def scenario(sandbox: Sandbox) -> None:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sandbox.run("sleep", 1.0), 0.2)
        assert await sandbox.run("echo", "mine") == "mine"
        assert await sandbox.run("echo", "mine too") == "mine too"

    run(scenario)
