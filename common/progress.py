"""A request's progress list: the ids of the tokens workers delivered for it, in order, from which the scheduler
moves it to another worker (its Submit's `resume`). PUBLISH_RESULTS (common/scripts.py) appends each token as it
is published and deletes the list as the request ends there; whatever else touches it is a named operation here."""

from __future__ import annotations

from typing import Any

from common.keys import Keys

# How long a progress list is kept from its first token: as long as a worker's keys (common/keys.py), so that
# whatever could still be resumed can still be found.
PROGRESS_TTL_SECONDS = 3600


class Progress:
    def __init__(self, keys: Keys) -> None:
        self.keys = keys

    def started(self, pipe: Any, request_id: str) -> None:
        """Its first token is published (before this, in the same pipeline): the list lives an hour from now."""
        pipe.expire(self.keys.progress(request_id), PROGRESS_TTL_SECONDS)

    def read(self, pipe: Any, request_id: str) -> None:
        """Queue a read of every token delivered so far (a list of ids as bytes, in the pipeline's answer)."""
        pipe.lrange(self.keys.progress(request_id), 0, -1)

    def forget(self, pipe: Any, request_id: str) -> None:
        """The request ended where no result was published for it (cancelled, or failed by the scheduler)."""
        pipe.delete(self.keys.progress(request_id))
