"""OpenAI's Files and Batch APIs: `/v1/files` holds a batch's input (JSONL of /v1/chat/completions or
/v1/completions requests, each line checked as its route checks a body) and its output and error files;
`/v1/batches` starts, lists, reads and cancels jobs, which the gateways run (gateway/batch_runner.py). Every file
and job belongs to the API key that made it: for another key it does not exist (404). POST /v1/files and POST
/v1/batches take an `Idempotency-Key` (gateway/idempotency.py): a retry with the same key and body gets the file or
job the first request made, not a second one."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Annotated, Literal, TypeVar

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from common.errors import ErrorCode
from gateway import idempotency
from gateway.batch_lines import ENDPOINTS, read_lines, window_seconds
from gateway.batch_runner import BatchRunner
from gateway.batch_store import BatchStore, Job, StoredFile
from gateway.errors import ApiError
from gateway.submits import tenant_of

router = APIRouter(prefix="/v1")
T = TypeVar("T")

MAX_METADATA = 16  # OpenAI's bound: 16 pairs, keys of 64 characters, values of 512
MAX_ID = 128


def store_of(request: Request) -> BatchStore:
    runner: BatchRunner = request.app.state.batches
    return runner.store


def owner_of(request: Request) -> str:
    return tenant_of(request) or ""


def found(record: T | None, what: str, ident: str, param: str) -> T:
    """The record, or the 404 that names it: unknown, deleted and another key's read alike."""
    if record is None:
        raise ApiError.of(ErrorCode.NOT_FOUND, f"no {what} '{ident[:MAX_ID]}' (unknown, deleted, or another key's)",
                          param)
    return record


async def owned_file(request: Request, file_id: str) -> StoredFile:
    stored = await store_of(request).file(file_id, owner_of(request)) if len(file_id) <= MAX_ID else None
    return found(stored, "file", file_id, "file_id")


async def owned_job(request: Request, batch_id: str) -> Job:
    job = await store_of(request).job(batch_id, owner_of(request)) if len(batch_id) <= MAX_ID else None
    return found(job, "batch", batch_id, "batch_id")


# Files.


@router.post("/files", summary="Upload a batch's input file (JSONL, purpose 'batch')")
async def create_file(request: Request, file: Annotated[UploadFile, File()],
                      purpose: Annotated[str, Form(max_length=64)]) -> dict[str, object]:
    if purpose != "batch":
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"purpose is '{purpose}'; this server keeps files for "
                          "batches only: 'batch'", "purpose")
    data = await file.read()
    limit = store_of(request).file_limit
    if len(data) > limit:
        raise ApiError.of(ErrorCode.REQUEST_TOO_LARGE, f"the file is {len(data)} bytes; at most {limit} "
                          "(BATCH_FILE_BYTES)", "file")
    await asyncio.to_thread(read_lines, data)  # a large file takes seconds: the other streams go on meanwhile
    store, owner, filename = store_of(request), owner_of(request), (file.filename or "input.jsonl")[:256]
    # The parts, not the raw body: a retried multipart upload has another boundary.
    digest = hashlib.sha256(b"\0".join([request.url.path.encode(), purpose.encode(), filename.encode(),
                                        hashlib.sha256(data).digest()])).hexdigest()
    file_id = store.new_file_id()
    claimed, earlier = await idempotency.made_or_claim(request, file_id, lambda held: store.file(held, owner),
                                                       digest)
    if earlier is not None:
        return earlier.public()
    try:
        stored = await store.add_file(owner, filename, purpose, data, file_id=file_id)
    except BaseException:
        if claimed is not None:
            await idempotency.release(request, claimed)
        raise
    return stored.public()


@router.get("/files", summary="This key's files, the newest first")
async def list_files(request: Request, purpose: str | None = Query(None, max_length=64),
                     after: str | None = Query(None, max_length=MAX_ID),
                     limit: int = Query(10000, ge=1, le=10000)) -> dict[str, object]:
    files = [f for f in await store_of(request).files(owner_of(request)) if purpose is None or f.purpose == purpose]
    return page_of(files, after, limit)


def page_of(records: list[StoredFile] | list[Job], after: str | None, limit: int) -> dict[str, object]:
    """One page of a list, in OpenAI's cursor shape: the records after the one named `after`, `limit` of them;
    `has_more` says whether the SDK's iteration asks for the next page."""
    if after is not None:
        ids = [record.id for record in records]
        records = records[ids.index(after) + 1:] if after in ids else []
    page = records[:limit]
    return {"object": "list", "data": [record.public() for record in page], "has_more": len(records) > limit,
            "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None}


@router.get("/files/{file_id}", summary="One file's description")
async def retrieve_file(request: Request, file_id: str) -> dict[str, object]:
    return (await owned_file(request, file_id)).public()


@router.get("/files/{file_id}/content", summary="One file's bytes")
async def file_content(request: Request, file_id: str) -> Response:
    await owned_file(request, file_id)
    data = await store_of(request).file_data(file_id)
    if data is None:
        raise ApiError.of(ErrorCode.NOT_FOUND, f"no file '{file_id}'", "file_id")
    return Response(data, media_type="application/jsonl")


@router.delete("/files/{file_id}", summary="Delete a file")
async def delete_file(request: Request, file_id: str) -> dict[str, object]:
    await owned_file(request, file_id)
    await store_of(request).delete_file(file_id, owner_of(request))
    return {"id": file_id, "object": "file", "deleted": True}


# Batches.


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_file_id: str = Field(..., min_length=1, max_length=MAX_ID)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"] = Field(
        ..., description=f"One of {', '.join(ENDPOINTS)}: every line's url.")
    completion_window: str = Field("24h", max_length=16, description="How long the job may take: 24h (OpenAI's "
                                   "one value); also minutes or seconds such as 90m or 600s, up to 7 days.")
    metadata: dict[str, str] | None = Field(None, max_length=MAX_METADATA)


@router.post("/batches", summary="Start a batch job over an uploaded file")
async def create_batch(body: BatchRequest, request: Request) -> dict[str, object]:
    window = window_seconds(body.completion_window)
    for key, value in (body.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise ApiError.of(ErrorCode.INVALID_VALUE, "metadata keys are at most 64 characters, values 512",
                              "metadata")
    stored = await owned_file(request, body.input_file_id)
    if stored.purpose != "batch":
        raise ApiError.of(ErrorCode.INVALID_VALUE, f"file '{stored.id}' has purpose '{stored.purpose}', not 'batch'",
                          "input_file_id")
    store, owner = store_of(request), owner_of(request)
    data = await store.file_data(stored.id) or b""
    lines = await asyncio.to_thread(read_lines, data, body.endpoint)
    # Claimed once the job is known good, so that it is made right after: a retry waits for it a moment at most.
    batch_id = store.new_batch_id()
    claimed, earlier = await idempotency.made_or_claim(request, batch_id, lambda held: store.job(held, owner))
    if earlier is not None:
        return earlier.public()
    try:
        job = await store.add_job(owner, body.endpoint, stored.id, body.completion_window, window, len(lines),
                                  body.metadata, batch_id)
    except BaseException:
        if claimed is not None:
            await idempotency.release(request, claimed)
        raise
    return job.public()


@router.get("/batches", summary="This key's batch jobs, the newest first")
async def list_batches(request: Request, after: str | None = Query(None, max_length=MAX_ID),
                       limit: int = Query(20, ge=1, le=100)) -> dict[str, object]:
    return page_of(await store_of(request).jobs(owner_of(request)), after, limit)


@router.get("/batches/{batch_id}", summary="One batch job, with its progress")
async def retrieve_batch(request: Request, batch_id: str) -> dict[str, object]:
    return (await owned_job(request, batch_id)).public()


@router.post("/batches/{batch_id}/cancel", summary="Cancel a batch job: the lines running are cancelled")
async def cancel_batch(request: Request, batch_id: str) -> dict[str, object]:
    job = await owned_job(request, batch_id)
    store = store_of(request)
    if not await store.move(job.id, "cancelling", "validating", "in_progress") and job.status != "cancelling":
        raise ApiError.of(ErrorCode.BATCH_ENDED, f"the batch is {job.status}: only a batch that has not ended can "
                          "be cancelled", "batch_id")
    return (await owned_job(request, batch_id)).public()
