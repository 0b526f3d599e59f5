"""The bus's streams, written the one way: a message encoded within MAX_MESSAGE_BYTES into the payload field, each
stream capped at its length, a worker's inbox given its expiry with every write. The readers' side is
common/runtime.py's decode-or-drop; admission writes the request stream inside its script (common/scripts.py),
given the field and cap from here (`admit_arguments`); dead letters are plain fields, for an operator."""

from __future__ import annotations

from typing import Any

from common.keys import (
    DEAD_LETTER_MAXLEN,
    EVENT_STREAM_MAXLEN,
    INBOX_MAXLEN,
    PAYLOAD,
    REQUEST_STREAM_MAXLEN,
    WORKER_KEYS_TTL_SECONDS,
    Keys,
)
from common.protocol import InboxMessage, RequestMessage, WorkerEvent, encode, now


class StreamWriter:
    def __init__(self, keys: Keys, limit: int) -> None:
        self.keys, self.limit = keys, limit

    def request(self, pipe: Any, message: RequestMessage | bytes) -> None:
        """To the scheduler's request stream: a message, or a Submit encoded already (one put back in the queue)."""
        payload = message if isinstance(message, bytes) else encode(message, self.limit)
        pipe.xadd(self.keys.requests, {PAYLOAD: payload}, maxlen=REQUEST_STREAM_MAXLEN, approximate=True)

    @staticmethod
    def admit_arguments() -> tuple[bytes, int]:
        """The request stream's payload field and cap, for ADMIT, which writes admitted requests in its script."""
        return PAYLOAD, REQUEST_STREAM_MAXLEN

    def inbox(self, pipe: Any, worker_id: str, message: InboxMessage) -> None:
        """To one worker. Its inbox may be deleted (the worker lost) by the time this lands: the expiry reaps it."""
        inbox = self.keys.inbox(worker_id)
        pipe.xadd(inbox, {PAYLOAD: encode(message, self.limit)}, maxlen=INBOX_MAXLEN, approximate=True)
        pipe.expire(inbox, WORKER_KEYS_TTL_SECONDS)

    def event(self, pipe: Any, message: WorkerEvent) -> None:
        """From a worker to the scheduler: a request finished or returned, or the worker handing its work off."""
        pipe.xadd(self.keys.events, {PAYLOAD: encode(message, self.limit)}, maxlen=EVENT_STREAM_MAXLEN,
                  approximate=True)

    def dead_letter(self, pipe: Any, request_id: str, reason: str, service: str) -> None:
        """A request set aside for an operator: its id, why, who set it aside and when, never its prompt."""
        pipe.xadd(self.keys.dead_letters, {b"request_id": request_id, b"reason": reason, b"service": service,
                                           b"at": str(now())}, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
