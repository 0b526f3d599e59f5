"""harness/sse.py, the one SSE parser of the tests and the benchmarks, read as they read it: httpx's iter_lines and
aiter_lines over a body cut into chunks anywhere."""

from __future__ import annotations

import asyncio

import httpx

from harness.sse import Event, aparse, parse

BODY = (b": a comment, as a keep-alive\n"
        b'retry: 1500\nid: 0\ndata: {"token":"a","index":0}\n\n'
        b'id: 1\ndata: {"token":"b",\ndata: "index":1}\r\n\r\n'
        b"\n"  # a blank line with no event before it
        b'event: error\ndata: {"error":{"code":"cancelled"}}\n\n'
        b'data: {"finish_reason":"length"}\n\n'
        b"data: [DONE]\n\n"
        b'id: 9\ndata: {"left":"without its blank line"}')

EXPECTED = [Event(None, "0", {"token": "a", "index": 0}, 1500, '{"token":"a","index":0}'),
            Event(None, "1", {"token": "b", "index": 1}, None, '{"token":"b",\n"index":1}'),
            Event("error", None, {"error": {"code": "cancelled"}}, None, '{"error":{"code":"cancelled"}}'),
            Event(None, None, {"finish_reason": "length"}, None, '{"finish_reason":"length"}'),
            Event(None, None, {}, None, "[DONE]")]


def chunks(size: int) -> list[bytes]:
    return [BODY[i:i + size] for i in range(0, len(BODY), size)]


def test_the_events_of_a_body_cut_anywhere() -> None:
    for size in (1, 2, 7, 64, len(BODY)):
        response = httpx.Response(200, content=iter(chunks(size)))
        got = list(parse(response.iter_lines()))
        assert got == EXPECTED, size
        assert got[-1].done and not got[0].done


def test_the_same_events_read_asynchronously() -> None:
    async def read(size: int) -> list[Event]:
        async def body():
            for chunk in chunks(size):
                yield chunk

        response = httpx.Response(200, content=body())
        return [event async for event in aparse(response.aiter_lines())]

    for size in (1, 5, len(BODY)):
        assert asyncio.run(read(size)) == EXPECTED, size
