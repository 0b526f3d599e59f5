"""Files and batch jobs in Redis: OpenAI's file and batch objects, each owned by the API key that made it (another
key finds nothing), a job's answers kept once a line (common/scripts.py RECORD_LINE), its status moved only
forward (MOVE_BATCH), and the lease by which one gateway at a time runs it."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from common import scripts

# How long an ended job and its output files are kept (OpenAI keeps them 30 days).
ENDED_TTL_SECONDS = 30 * 24 * 3600
ENDED = ("completed", "failed", "expired", "cancelled")
TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
         "cancelled_at")


class BatchKeys:
    """Key names: a file's and a job's own keys share its id's hash tag; the per-owner lists and the set of jobs
    to run share the namespace's."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace

    def file(self, file_id: str) -> str:
        return f"{self.ns}:file:{{{file_id}}}"

    def files(self, owner: str) -> str:
        return f"{{{self.ns}}}:files:{owner}"

    def job(self, batch_id: str) -> str:
        return f"{self.ns}:batch:{{{batch_id}}}"

    def answers(self, batch_id: str) -> str:
        """Hash of line number -> its answer, 'o' (output file) or 'e' (error file) and the line's JSON."""
        return f"{self.ns}:batch:{{{batch_id}}}:answers"

    def in_flight(self, batch_id: str) -> str:
        """Hash of line number -> the request_id of the stream now answering it."""
        return f"{self.ns}:batch:{{{batch_id}}}:inflight"

    def lease(self, batch_id: str) -> str:
        return f"{self.ns}:batch:{{{batch_id}}}:lease"

    def jobs(self, owner: str) -> str:
        return f"{{{self.ns}}}:batches:{owner}"

    @property
    def to_run(self) -> str:
        return f"{{{self.ns}}}:batches:active"


@dataclass(frozen=True)
class StoredFile:
    id: str
    owner: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def public(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed", "expires_at": None}


@dataclass
class Job:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    total: int
    completed: int = 0
    failed: int = 0
    times: dict[str, int] = field(default_factory=dict)
    output_file_id: str | None = None
    error_file_id: str | None = None
    metadata: dict[str, str] | None = None
    errors: list[dict[str, Any]] | None = None

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def public(self) -> dict[str, Any]:
        errors = {"object": "list", "data": self.errors} if self.errors else None
        return {"id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": errors,
                "input_file_id": self.input_file_id, "completion_window": self.completion_window,
                "status": self.status, "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
                "created_at": self.created_at, "expires_at": self.expires_at,
                **{name: self.times.get(name) for name in TIMES},
                "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
                "metadata": self.metadata}

    @classmethod
    def of(cls, raw: dict[bytes, bytes]) -> Job:
        values = {k.decode(): v.decode() for k, v in raw.items()}
        return cls(values["id"], values["owner"], values["endpoint"], values["input_file_id"],
                   values["completion_window"], values["status"], int(values["created_at"]),
                   int(values["expires_at"]), int(values["total"]), int(values.get("completed", 0)),
                   int(values.get("failed", 0)), {name: int(values[name]) for name in TIMES if name in values},
                   values.get("output_file_id") or None, values.get("error_file_id") or None,
                   json.loads(values.get("metadata", "null")), json.loads(values.get("errors", "null")))


class BatchStore:
    def __init__(self, redis: Redis, namespace: str, file_limit: int) -> None:
        self.redis = redis
        self.keys = BatchKeys(namespace)
        self.file_limit = file_limit

    # Files.

    async def add_file(self, owner: str, filename: str, purpose: str, data: bytes, file_id: str = "",
                       ttl: int = 0) -> StoredFile:
        stored = StoredFile(file_id or self.new_file_id(), owner, filename, purpose, len(data),
                            int(time.time()))
        key = self.keys.file(stored.id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping={"owner": owner, "filename": filename, "purpose": purpose,
                                "created_at": stored.created_at, "data": data})
        if ttl:
            pipe.expire(key, ttl)
        pipe.zadd(self.keys.files(owner), {stored.id: stored.created_at})
        await pipe.execute()
        return stored

    async def file(self, file_id: str, owner: str) -> StoredFile | None:
        raw = await self.redis.hmget(self.keys.file(file_id), "owner", "filename", "purpose", "created_at")
        if raw[0] is None or raw[0].decode() != owner:
            return None
        size = await self.redis.hstrlen(self.keys.file(file_id), "data")
        return StoredFile(file_id, owner, raw[1].decode(), raw[2].decode(), size, int(raw[3]))

    async def file_data(self, file_id: str) -> bytes | None:
        return await self.redis.hget(self.keys.file(file_id), "data")

    async def files(self, owner: str) -> list[StoredFile]:
        found = []
        for file_id in await self.redis.zrevrange(self.keys.files(owner), 0, -1):
            stored = await self.file(file_id.decode(), owner)
            if stored is None:  # expired (an ended job's output): forgotten here too
                await self.redis.zrem(self.keys.files(owner), file_id)
            else:
                found.append(stored)
        return found

    async def delete_file(self, file_id: str, owner: str) -> bool:
        if await self.file(file_id, owner) is None:
            return False
        await self.redis.delete(self.keys.file(file_id))
        await self.redis.zrem(self.keys.files(owner), file_id)
        return True

    # Jobs.

    @staticmethod
    def new_file_id() -> str:
        return f"file-{uuid.uuid4().hex}"

    @staticmethod
    def new_batch_id() -> str:
        return f"batch_{uuid.uuid4().hex}"

    async def add_job(self, owner: str, endpoint: str, input_file_id: str, window: str, window_s: int, total: int,
                      metadata: dict[str, str] | None, batch_id: str = "") -> Job:
        now = int(time.time())
        job = Job(batch_id or self.new_batch_id(), owner, endpoint, input_file_id, window, "validating", now,
                  now + window_s, total, metadata=metadata)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.job(job.id), mapping={
            "id": job.id, "owner": owner, "endpoint": endpoint, "input_file_id": input_file_id,
            "completion_window": window, "status": job.status, "created_at": now, "expires_at": job.expires_at,
            "total": total, "completed": 0, "failed": 0, "metadata": json.dumps(metadata)})
        pipe.zadd(self.keys.jobs(owner), {job.id: now})
        pipe.sadd(self.keys.to_run, job.id)
        await pipe.execute()
        return job

    async def job(self, batch_id: str, owner: str | None = None) -> Job | None:
        raw = await self.redis.hgetall(self.keys.job(batch_id))
        if not raw:
            return None
        job = Job.of(raw)
        return job if owner is None or job.owner == owner else None

    async def jobs(self, owner: str) -> list[Job]:
        """The owner's jobs, the newest first."""
        found = []
        for batch_id in await self.redis.zrevrange(self.keys.jobs(owner), 0, -1):
            job = await self.job(batch_id.decode(), owner)
            if job is None:
                await self.redis.zrem(self.keys.jobs(owner), batch_id)
            else:
                found.append(job)
        return found

    async def move(self, batch_id: str, status: str, *from_: str) -> bool:
        """Move the job to `status` if it is in one of `from_`, stamping the time (`<status>_at`)."""
        moved = await self.redis.eval(scripts.MOVE_BATCH, 1, self.keys.job(batch_id), status, f"{status}_at",
                                      int(time.time()), *from_)
        return bool(moved)

    async def fail(self, batch_id: str, code: str, message: str) -> None:
        await self.redis.hset(self.keys.job(batch_id), "errors",
                              json.dumps([{"code": code, "message": message, "param": None, "line": None}]))
        await self.move(batch_id, "failed", "validating", "in_progress")
        await self.end(batch_id)

    async def to_run(self) -> list[str]:
        return [batch_id.decode() for batch_id in await self.redis.smembers(self.keys.to_run)]

    async def end(self, batch_id: str) -> None:
        """An ended job is run no more, and kept ENDED_TTL_SECONDS."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.srem(self.keys.to_run, batch_id)
        for key in (self.keys.job(batch_id), self.keys.answers(batch_id)):
            pipe.expire(key, ENDED_TTL_SECONDS)
        pipe.delete(self.keys.in_flight(batch_id))
        await pipe.execute()

    # Running one.

    async def lease(self, batch_id: str, holder: str, ttl_ms: int) -> bool:
        """Take the job's lease, or extend it if `holder` has it."""
        return bool(await self.redis.eval(scripts.LEADER_LEASE, 1, self.keys.lease(batch_id), holder, ttl_ms))

    async def release(self, batch_id: str, holder: str) -> None:
        await self.redis.eval(scripts.RELEASE_CLAIM, 1, self.keys.lease(batch_id), holder)

    async def answered_lines(self, batch_id: str) -> set[int]:
        return {int(k) for k in await self.redis.hkeys(self.keys.answers(batch_id))}

    async def answered(self, batch_id: str) -> dict[int, bytes]:
        return {int(k): v for k, v in (await self.redis.hgetall(self.keys.answers(batch_id))).items()}

    async def in_flight(self, batch_id: str) -> dict[int, str]:
        return {int(k): v.decode() for k, v in (await self.redis.hgetall(self.keys.in_flight(batch_id))).items()}

    async def started(self, batch_id: str, number: int, request_id: str) -> None:
        await self.redis.hset(self.keys.in_flight(batch_id), str(number), request_id)

    async def record(self, batch_id: str, number: int, answer: dict[str, Any], ok: bool) -> None:
        keys = (self.keys.answers(batch_id), self.keys.job(batch_id), self.keys.in_flight(batch_id))
        value = ("o" if ok else "e") + json.dumps(answer)
        await self.redis.eval(scripts.RECORD_LINE, 3, *keys, number, value, "completed" if ok else "failed")

    async def set_files(self, batch_id: str, output_file_id: str | None, error_file_id: str | None) -> None:
        await self.redis.hset(self.keys.job(batch_id), mapping={"output_file_id": output_file_id or "",
                                                                "error_file_id": error_file_id or ""})
