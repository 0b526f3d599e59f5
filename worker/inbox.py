"""A worker's inbox, read in order between two engine steps: what the scheduler sends it (batches to admit,
cancels, yields) and the gateways' tokenizer questions, whose answer is made here. Each message is decoded (a
malformed one is logged and dropped) and the entries read are deleted once the loop has handled them: what the
worker holds from then on lives in its engine, and in its assignments in Redis."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import redis

from common.errors import ErrorCode
from common.keys import PAYLOAD, Keys
from common.protocol import Detokenize, Error, InboxMessage, ProtocolError, Tokenize, encode
from common.resultlog import publish_results
from common.runtime import decode_or_drop
from common.settings import WorkerSettings
from worker.core import Model

log = logging.getLogger("worker")


class Inbox:
    def __init__(self, client: redis.Redis, keys: Keys, worker_id: str, settings: WorkerSettings) -> None:
        self.redis, self.keys, self.settings = client, keys, settings
        self.key, self.limit = keys.inbox(worker_id), settings.max_message_bytes
        self.cursor = "0-0"

    def read(self, wait_ms: int | None) -> Iterator[InboxMessage]:
        """The messages since the last read, in order, waiting up to `wait_ms` for one (None: not at all)."""
        for _stream, entries in self.redis.xread({self.key: self.cursor}, block=wait_ms):
            for entry_id, fields in entries:
                self.cursor = entry_id
                message = decode_or_drop(fields.get(PAYLOAD), InboxMessage, self.limit, log,
                                         "a malformed inbox message", entry=entry_id)
                if message is not None:
                    yield message
            self.redis.xdel(self.key, *(entry_id for entry_id, _ in entries))

    def answer(self, loaded: Model, job: Tokenize | Detokenize) -> None:
        """/tokenize and /detokenize, between two steps (the tokenizer is the model's, and only the worker's loop
        uses it): the token ids or text, or the error that says why not, on the request's results channel."""
        pipe = self.redis.pipeline(transaction=False)
        publish_results(pipe, self.keys, self.settings, [(job.request_id, self._answer(loaded, job), "")])
        pipe.execute()

    def _answer(self, loaded: Model, job: Tokenize | Detokenize) -> bytes:
        try:
            return encode(loaded.answer(job), self.limit)
        except ProtocolError as exc:
            return encode(Error(ErrorCode.REQUEST_TOO_LARGE, f"the answer does not fit one bus message: {exc}"),
                          self.limit)
        except Exception as exc:  # whatever the text does to the tokenizer or its template, the worker goes on
            log.warning("tokenize failed", extra={"request_id": job.request_id, "error": str(exc)})
            return encode(Error(ErrorCode.INVALID_VALUE, f"the tokenizer could not take it: {exc}"[:4096]),
                          self.limit)
