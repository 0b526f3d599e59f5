"""Batch jobs, run by whichever gateway holds each one's lease. Every second a gateway looks for jobs that no
gateway runs and takes their lease; the holder admits the job's lines (BATCH_IN_FLIGHT at a time) to the
scheduler's background lane, reads each answer as a client of a whole answer would, and records it once
(gateway/batch_store.py). A gateway that dies leaves the lease to lapse (in less than a stream's RESUME_GRACE):
the next holder follows the lines still running from their results logs and runs again only those cancelled
meanwhile. At the end the output and error files are written and the job completes; or it expires (its window
passed: the lines left are failed `batch_expired`); or it is cancelled (the lines running are cancelled, and
those not answered are not counted)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from common.errors import ErrorCode
from common.protocol import Result, StreamMeta
from common.runtime import REDIS_ERRORS, service_id
from gateway import metrics, openai_api
from gateway.admission import Refused
from gateway.batch_lines import Line, answered, read_lines, unanswered
from gateway.batch_store import ENDED_TTL_SECONDS, BatchStore, Job
from gateway.bus import Bus
from gateway.errors import ApiError
from gateway.results import BROKEN
from gateway.streams import ResultStream

log = logging.getLogger("gateway")

LOOK_SECONDS = 1.0
LEASE_MS = 3000  # under RESUME_GRACE's default: a successor follows the lines before their streams' leases lapse
RETRY_SECONDS = 1.0  # after a full queue or a Redis error
MAX_RUNS = 3  # a line cancelled by someone else this often is failed, not run again

Answer = tuple[dict[str, Any], bool]  # a line's answer, and whether it goes to the output file (else errors)
AGAIN, CANCELLED = "again", "cancelled"  # a line to run anew; one whose stream someone else cancelled
Outcome = Answer | str


@dataclass
class Refusal:
    """A line refused before it ran: its answer."""
    answer: Answer


class BatchRunner:
    def __init__(self, app: FastAPI, bus: Bus) -> None:
        self.app, self.bus = app, bus
        self.store = BatchStore(bus.redis, bus.settings.namespace, bus.settings.batch_file_bytes)
        self.holder = service_id()  # host-pid-random: the lease names the process that runs the job
        self.runs: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._look())

    async def stop(self) -> None:
        """Stop running jobs, leaving their lines' streams to their leases and the jobs to another gateway."""
        tasks = [t for t in (self._task, *self.runs.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _look(self) -> None:
        while True:
            try:
                for batch_id in await self.store.to_run():
                    if batch_id not in self.runs and await self.store.lease(batch_id, self.holder, LEASE_MS):
                        self._run(batch_id)
            except (*REDIS_ERRORS, OSError) as exc:
                log.warning("batch jobs unreadable", extra={"error": str(exc)})
            await asyncio.sleep(LOOK_SECONDS)

    def _run(self, batch_id: str) -> None:
        log.info("batch job taken", extra={"batch_id": batch_id, "holder": self.holder})
        task = asyncio.create_task(JobRun(self, batch_id).run())
        self.runs[batch_id] = task
        metrics.BATCH_JOBS.set(len(self.runs))
        task.add_done_callback(lambda _: self._ran(batch_id))

    def _ran(self, batch_id: str) -> None:
        self.runs.pop(batch_id, None)
        metrics.BATCH_JOBS.set(len(self.runs))

    def request_of(self, owner: str, url: str) -> Request:
        """A line runs through the route's own checks as a request of the key that made the job."""
        state = {"tenant": owner} if owner and self.bus.settings.keyed() else {}
        return Request({"type": "http", "app": self.app, "method": "POST", "path": url, "headers": [],
                        "query_string": b"", "state": state})


class JobRun:
    """One gateway's run of one job, until it ends or the gateway stops (or loses the lease)."""

    def __init__(self, runner: BatchRunner, batch_id: str) -> None:
        self.runner, self.batch_id = runner, batch_id
        self.store, self.bus = runner.store, runner.bus
        self.tasks: list[asyncio.Task[None]] = []
        self.ending: str | None = None  # "cancelled" or "expired", once decided
        self.lost = False
        self.left = 0  # its lines not yet answered, counted in BATCH_LINES_LEFT while this run holds the job
        # One line starts at a time (stamped, followed, admitted), so the scheduler reads and starts them in the
        # file's order: lines admitted side by side could reach it in any order and start out of it.
        self.starting = asyncio.Lock()

    async def run(self) -> None:
        try:
            await self._run()
        except asyncio.CancelledError:
            await self._stop_lines()
            raise
        except Exception:
            log.exception("batch job run failed", extra={"batch_id": self.batch_id})
            await self._stop_lines()
        finally:
            metrics.BATCH_LINES_LEFT.dec(self.left)  # the job ended, or is left to another gateway
            self.left = 0
            if not self.lost:
                with contextlib.suppress(*REDIS_ERRORS, OSError):
                    await self.store.release(self.batch_id, self.runner.holder)

    async def _run(self) -> None:
        job = await self.store.job(self.batch_id)
        if job is None or job.ended:
            await self.store.end(self.batch_id)
            return
        lines = await self._lines(job)
        if lines is None:
            return
        await self.store.move(job.id, "in_progress", "validating")
        if job.status == "cancelling":
            self.ending = "cancelled"
        else:
            answers, in_flight = await self.store.answered_lines(job.id), await self.store.in_flight(job.id)
            todo = deque(sorted((line for line in lines if line.number not in answers),
                                key=lambda line: line.number not in in_flight))  # the running first: leases lapse
            self.left = len(todo)
            metrics.BATCH_LINES_LEFT.inc(self.left)
            # BATCH_IN_FLIGHT lanes, each taking the next line as its last one ends.
            lanes = min(self.bus.settings.batch_in_flight, len(todo))
            self.tasks = [asyncio.create_task(self._lane(job, todo, in_flight)) for _ in range(lanes)]
            watch = asyncio.create_task(self._watch(job))
            try:
                await asyncio.gather(*self.tasks, return_exceptions=True)
            finally:
                watch.cancel()
        if not self.lost:
            await self._finish(job, lines)

    async def _lines(self, job: Job) -> list[Line] | None:
        data = await self.store.file_data(job.input_file_id)
        if data is None:
            await self.store.fail(job.id, "file_not_found", f"the input file {job.input_file_id} was deleted")
            return None
        try:  # in a thread: a large file takes seconds to read, which the gateway's other streams must not wait
            return await asyncio.to_thread(read_lines, data, job.endpoint)
        except ApiError as error:
            await self.store.fail(job.id, "invalid_file", error.message)
            return None

    async def _watch(self, job: Job) -> None:
        """Keep the lease, and end the lines when the job is cancelled or its window passes."""
        while True:
            await asyncio.sleep(LEASE_MS / 3000)
            try:
                held = await self.store.lease(job.id, self.runner.holder, LEASE_MS)
                now = await self.store.job(job.id)
            except (*REDIS_ERRORS, OSError):
                continue
            if not held:
                self.lost = True
                log.warning("batch job lease lost", extra={"batch_id": job.id})
            elif now is not None and now.status == "cancelling":
                self.ending = "cancelled"
            elif time.time() >= job.expires_at:
                self.ending = "expired"
            if self.lost or self.ending:
                await self._stop_lines()
                return

    async def _stop_lines(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # One line.

    async def _lane(self, job: Job, todo: deque[Line], in_flight: dict[int, str]) -> None:
        while todo:
            line = todo.popleft()
            await self._line(job, line, in_flight.get(line.number))

    async def _line(self, job: Job, line: Line, request_id: str | None) -> None:
        """Answer one line: follow the stream already answering it, else run it; run it again when its stream
        was cancelled by someone else than this job (at most MAX_RUNS times) or broke with Redis."""
        cancelled = 0
        while True:
            try:
                outcome = await self._follow(job, line, request_id) if request_id else AGAIN
                if outcome is AGAIN:
                    request_id, outcome = await self._submit(job, line)
            except (*REDIS_ERRORS, OSError) as exc:
                log.warning("batch line interrupted", extra={"batch_id": job.id, "line": line.number,
                                                              "error": str(exc)})
                await asyncio.sleep(RETRY_SECONDS)
                continue  # its stream, if it was admitted, is followed
            if isinstance(outcome, tuple):
                await self._record(job, line, outcome)
                return
            request_id = None
            if outcome is CANCELLED:
                cancelled += 1
                if cancelled == MAX_RUNS:
                    body = ApiError.of(ErrorCode.CANCELLED, f"the line was cancelled {MAX_RUNS} times, by others "
                                       "than its batch").body()
                    await self._record(job, line, (answered(line, "", ErrorCode.CANCELLED.status, body), False))
                    return

    async def _record(self, job: Job, line: Line, answer: Answer) -> None:
        await self.store.record(job.id, line.number, *answer)
        metrics.BATCH_LINES.labels("completed" if answer[1] else "failed").inc()
        if self.left:
            self.left -= 1
            metrics.BATCH_LINES_LEFT.dec()

    async def _submit(self, job: Job, line: Line) -> tuple[str | None, Outcome]:
        """Run the line anew: its request_id, and how it went. While the queue is full, wait for room."""
        async with self.starting:
            head, started = await self._start(job, line)
        if isinstance(started, Refusal):
            return head, started.answer
        return head, await self._collect(job, line, *started)

    async def _start(self, job: Job, line: Line) -> tuple[str | None, tuple[ResultStream, StreamMeta] | Refusal]:
        """Stamp the line's request, follow its stream and admit it: the stream open before the scheduler can
        answer, the answer when the line is refused."""
        request = self.runner.request_of(job.owner, line.url)
        try:
            submits = await openai_api.submits_of(request, line.body)
        except ApiError as error:
            return None, Refusal((answered(line, f"{job.id}-{line.number}", error.status, error.body()), False))
        for submit in submits:
            submit.background, submit.deadline = True, float(job.expires_at)
        meta = openai_api.answer_meta(request, line.body, submits)
        head = meta.request_ids[0]
        await self.store.started(job.id, line.number, head)
        while True:
            stream = ResultStream(self.bus, meta.request_ids, meta, stop_on_error=True, tenant=submits[0].tenant,
                                  background=True)
            try:
                await stream.open()
                await stream.admit(submits)
                return head, (stream, meta)
            except Refused as refused:
                await stream.let_go()
                if refused.code is not ErrorCode.QUEUE_FULL:
                    body = ApiError.of(refused.code, refused.message, refused.param).body()
                    return head, Refusal((answered(line, head, refused.code.status, body), False))
                await asyncio.sleep(RETRY_SECONDS)
            except BaseException:
                await stream.let_go()
                raise

    async def _follow(self, job: Job, line: Line, request_id: str) -> Outcome:
        """Read a line's stream that was admitted before (by this gateway or another), from its start."""
        meta = await self.bus.ledger.stream_meta(request_id)
        if meta is None:
            return AGAIN
        stream = ResultStream(self.bus, meta.request_ids, meta, stop_on_error=True, tenant=meta.tenant,
                              background=True)
        try:
            await stream.open()
            await stream.replay()
            await stream.hold()
        except ApiError:
            await stream.let_go()
            return AGAIN
        except BaseException:
            await stream.let_go()
            raise
        return await self._collect(job, line, stream, meta)

    async def _collect(self, job: Job, line: Line, stream: ResultStream, meta: StreamMeta) -> Outcome:
        collected: list[list[Result]] = [[] for _ in meta.request_ids]
        leaving = False
        try:
            async for choice, result in stream:
                collected[choice].append(result)
        except asyncio.CancelledError:
            # The gateway stops or lost the job: the stream is left to its lease for the job's next runner.
            leaving = self.ending is None
            raise
        finally:
            await stream.close(client_left=leaving)
        head = meta.request_ids[0]
        error = next(iter(stream.errors.values()), None)
        if error is None:
            return answered(line, head, 200, openai_api.whole_answer(meta, collected)), True
        if any(error is broken for broken in BROKEN):
            return AGAIN  # this gateway lost Redis, which cancelled the stream: not the line's fault
        if error.code == ErrorCode.CANCELLED:
            return CANCELLED  # not by this job: its stream's lease lapsed, or its owner cancelled the request
        if error.code == ErrorCode.QUEUE_TIMEOUT and time.time() >= job.expires_at:
            return unanswered(line, "batch_expired", "the batch's completion window passed before this line ran"), False
        refused = ApiError.of_result(error)
        return answered(line, head, refused.status, refused.body()), False

    # The end.

    async def _finish(self, job: Job, lines: list[Line]) -> None:
        status = self.ending or "completed"
        if status == "expired":
            answers = await self.store.answered_lines(job.id)
            for line in lines:
                if line.number not in answers:
                    await self._record(job, line, (unanswered(
                        line, "batch_expired", "the batch's completion window passed before this line ran"), False))
        if status == "completed":
            await self.store.move(job.id, "finalizing", "in_progress")
        answers = await self.store.answered(job.id)
        output = [answers[n][1:] for n in sorted(answers) if answers[n][:1] == b"o"]
        errors = [answers[n][1:] for n in sorted(answers) if answers[n][:1] == b"e"]
        output_id = await self._write(job, "output", output)
        error_id = await self._write(job, "error", errors)
        await self.store.set_files(job.id, output_id, error_id)
        await self.store.move(job.id, status, "validating", "in_progress", "finalizing", "cancelling")
        await self.store.end(job.id)
        log.info("batch job ended", extra={"batch_id": job.id, "status": status, "completed": len(output),
                                           "failed": len(errors)})

    async def _write(self, job: Job, kind: str, lines: list[bytes]) -> str | None:
        if not lines:
            return None
        data = b"".join(line + b"\n" for line in lines)
        stored = await self.store.add_file(job.owner, f"{job.id}_{kind}.jsonl", "batch_output", data,
                                           file_id=f"file-{job.id.removeprefix('batch_')}-{kind}",
                                           ttl=ENDED_TTL_SECONDS)
        return stored.id
