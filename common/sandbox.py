"""A client's input handed to native code in a child process, so that what the native code does with it
(a stack overflow, an allocation past every bound, a loop that never ends) costs that one call and never
the service. The gateway compiles each request's grammar this way (gateway/grammar_check.py).

A `Sandbox` keeps a few children of `python -m common.sandbox <module:function>`, each running one job at
a time. A job's arguments and its answer cross the pipe as msgpack frames; inside the child the job runs in
a thread with a small stack, so that an input that compiles there compiles anywhere the service itself
runs it (threads there get the system's default, several times larger), and under a bound on the child's
address space. A job that raises answers `Refused` with its message; a child that dies, runs past its
time, or whose caller goes away is killed and replaced: that call alone fails (`Failed`)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import resource
import signal
import struct
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

log = logging.getLogger("sandbox")

FRAME = struct.Struct("<I")
REAP_SECONDS = 2.0


@dataclass(frozen=True)
class Limits:
    seconds: float = 5.0  # one job, from its arguments sent to its answer read
    memory_bytes: int = 1 << 30  # the child's address space
    stack_bytes: int = 4 << 20  # the job thread's stack
    frame_bytes: int = 8 << 20  # one message either way


class Refused(Exception):
    """The job refused its input (it raised); the message is the job's."""


class Failed(Exception):
    """The child died or ran past its time while running the job; the message says which."""


class Sandbox:
    def __init__(self, job: str, children: int = 2, limits: Limits = Limits()) -> None:
        self.job = job
        self.limits = limits
        self._turns = asyncio.Semaphore(children)  # jobs at once
        self._idle: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        """Start one child now, so that the first call does not wait for the interpreter to start."""
        if not self._idle:
            self._idle.append(await self._spawn())

    async def run(self, *args: object) -> object:
        async with self._turns:
            child = self._idle.pop() if self._idle else await self._spawn()
            try:
                answer = await asyncio.wait_for(self._ask(child, args), self.limits.seconds)
            except TimeoutError:
                await self._discard(child)
                raise Failed(f"ran past the sandbox's {self.limits.seconds:g} s") from None
            except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
                raise Failed(_death(await self._reap(child))) from None
            except BaseException:  # the caller went away mid-job: the child's answer would reach the next caller
                await self._discard(child)
                raise
            self._idle.append(child)
        status, payload = answer
        if status != "ok":
            raise Refused(str(payload))
        return payload

    async def close(self) -> None:
        while self._idle:
            await self._discard(self._idle.pop())

    async def _spawn(self) -> asyncio.subprocess.Process:
        limits = self.limits
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "common.sandbox", self.job, str(limits.memory_bytes), str(limits.stack_bytes),
            str(limits.frame_bytes), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)

    async def _ask(self, child: asyncio.subprocess.Process, args: tuple[object, ...]) -> tuple[str, object]:
        assert child.stdin is not None and child.stdout is not None
        payload = msgspec.msgpack.encode(list(args))
        child.stdin.write(FRAME.pack(len(payload)) + payload)
        await child.stdin.drain()
        (size,) = FRAME.unpack(await child.stdout.readexactly(FRAME.size))
        if size > self.limits.frame_bytes:
            raise ConnectionError(f"an answer of {size} bytes")
        status, answer = msgspec.msgpack.decode(await child.stdout.readexactly(size))
        return status, answer

    async def _discard(self, child: asyncio.subprocess.Process) -> int | None:
        """Kill the child and reap it; returns how it ended."""
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        # Shielded: a cancelled caller must still reap its child.
        return await asyncio.shield(child.wait())

    async def _reap(self, child: asyncio.subprocess.Process) -> int | None:
        """How a child that closed its pipe ended. Not killed first: a signal to a child that has just died
        makes asyncio reap it behind its own watcher's back, and its exit status is lost."""
        try:
            return await asyncio.wait_for(asyncio.shield(child.wait()), REAP_SECONDS)
        except TimeoutError:
            return await self._discard(child)


def _death(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"crashed the sandbox ({signal.Signals(-code).name})"
    return f"ended the sandbox (exit status {code})"


# The child.


def _serve(job: Callable[..., object], stack_bytes: int, frame_bytes: int) -> None:
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    while header := requests.read(FRAME.size):
        (size,) = FRAME.unpack(header)
        if size > frame_bytes:
            return
        args = msgspec.msgpack.decode(requests.read(size))
        answer = _run_small_stack(job, args, stack_bytes)
        payload = msgspec.msgpack.encode(answer)
        answers.write(FRAME.pack(len(payload)) + payload)
        answers.flush()


def _run_small_stack(job: Callable[..., object], args: list[object], stack_bytes: int) -> list[object]:
    answer: list[object] = ["refused", "the job gave no answer"]

    def run() -> None:
        try:
            answer[:] = ["ok", job(*args)]
        except BaseException as exc:  # RecursionError, MemoryError, SystemExit: the input's doing, refused too
            answer[:] = ["refused", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__]

    threading.stack_size(stack_bytes)
    thread = threading.Thread(target=run, name="sandboxed-job")
    thread.start()
    thread.join()
    return answer


def main() -> None:
    target, memory_bytes, stack_bytes, frame_bytes = sys.argv[1], *map(int, sys.argv[2:5])
    module, _, name = target.partition(":")
    job = getattr(importlib.import_module(module), name)
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    # A gateway that stops (Ctrl-C in a terminal signals the whole group) ends its children by closing the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(5)  # a slow job yields the core to the service's own event loop
    _serve(job, stack_bytes, frame_bytes)


if __name__ == "__main__":
    main()
