"""The gateway's result router (gateway/results.py) against a real redis-server that requires a
password: routing by request and choice, and a refused connection that fails requests at once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from common.keys import Keys
from common.protocol import Done, Error, Token, encode
from gateway.mailbox import Mailbox
from gateway.results import ResultRouter, command
from tests.conftest import redis_server

PASSWORD = "s3cret"
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with redis_server(PASSWORD) as url:
        yield urlparse(url).port


def test_commands_are_encoded_as_resp() -> None:
    assert command("SUBSCRIBE", b"a:1", "b") == b"*3\r\n$9\r\nSUBSCRIBE\r\n$3\r\na:1\r\n$1\r\nb\r\n"


def test_each_result_reaches_the_mailbox_and_choice_of_its_request(port: int) -> None:
    url, keys = f"redis://:{PASSWORD}@127.0.0.1:{port}/0", Keys("t")

    async def scenario() -> list[tuple[int, object]]:
        router, publisher = ResultRouter(url, keys, LIMIT), aioredis.from_url(url)
        await router.start()
        try:
            async with router.open(["r1", "r2"]) as both, router.open(["other"]) as other:
                await publisher.publish(keys.results("r2"), encode(Token(0, "hi"), LIMIT))
                await publisher.publish(keys.results("r1"), encode(Done("length", 3, 1), LIMIT))
                await publisher.publish(keys.results("nobody"), encode(Token(0, "lost"), LIMIT))
                got = [await asyncio.wait_for(both.get(), 5) for _ in range(2)]
                assert other.empty()
            async with router.open(["r3"]) as later:  # the connection serves on after the first requests left
                await publisher.publish(keys.results("r3"), b"\xff not msgpack")  # dropped, logged
                await publisher.publish(keys.results("r3"), encode(Token(0, "ok"), LIMIT))
                got.append(await asyncio.wait_for(later.get(), 5))
            return got
        finally:
            await router.stop()
            await publisher.aclose()

    assert asyncio.run(scenario()) == [(1, Token(0, "hi")), (0, Done("length", 3, 1)), (0, Token(0, "ok"))]


def test_a_refused_password_fails_requests_at_once(port: int) -> None:
    async def scenario() -> None:
        router = ResultRouter(f"redis://:wrong@127.0.0.1:{port}/0", Keys("t"), LIMIT)
        await router.start()
        try:
            with pytest.raises(RedisError):
                async with asyncio.timeout(5), router.open(["r1"]):
                    pass
        finally:
            await router.stop()

    asyncio.run(scenario())


def test_a_mailbox_past_its_bound_drops_its_results_and_holds_one_error_per_choice() -> None:
    async def scenario() -> tuple[list[tuple[int, object]], int]:
        overflows = []
        token = encode(Token(0, "word"), LIMIT)
        mailbox = Mailbox(["r1", "r2"], LIMIT, limit=4 * len(token) + 40, on_overflow=lambda: overflows.append(1))
        mailbox.deliver(0, token)
        assert (await mailbox.get()) == (0, Token(0, "word"))  # what is taken frees its room
        for _ in range(4):
            mailbox.deliver(1, token)
        assert not overflows and len(mailbox.data) < mailbox.limit
        mailbox.deliver(0, token)  # the one too many
        mailbox.deliver(0, encode(Done("length", 1, 1), LIMIT))  # dropped: the request is over
        return [await mailbox.get() for _ in range(2)], len(overflows)

    got, overflows = asyncio.run(scenario())
    assert overflows == 1
    assert [choice for choice, _ in got] == [0, 1]
    assert all(isinstance(error, Error) and error.code == "client_too_slow" for _, error in got)


def test_a_mailbox_takes_a_first_result_larger_than_its_bound() -> None:
    async def scenario() -> object:
        mailbox = Mailbox(["r1"], LIMIT, limit=16)
        mailbox.deliver(0, encode(Token(0, "a long word, longer than the bound"), LIMIT))
        return await mailbox.get()

    assert asyncio.run(scenario()) == (0, Token(0, "a long word, longer than the bound"))
