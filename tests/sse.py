"""A small SSE reader for the tests: events as (event, id, data) as a client sees them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx


@dataclass
class Event:
    event: str | None
    id: str | None
    data: dict


def events(response: httpx.Response) -> Iterator[Event]:
    event, event_id, data = None, None, []
    for line in response.iter_lines():
        if not line:
            if data:
                yield Event(event, event_id, json.loads("\n".join(data)))
            event, event_id, data = None, None, []
        elif line.startswith("data:"):
            data.append(line[5:].strip())
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("event:"):
            event = line[6:].strip()


def stream(client: httpx.Client, body: dict) -> tuple[str, list[Event]]:
    with client.stream("POST", "/generate_stream", json=body) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return response.headers["x-request-id"], list(events(response))
