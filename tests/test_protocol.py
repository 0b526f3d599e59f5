import re
from pathlib import Path

import msgspec
import pytest

from common.errors import ErrorCode
from common.protocol import (
    Batch,
    Cancel,
    ChatMessage,
    Done,
    Error,
    Finished,
    Heartbeat,
    InboxMessage,
    ProtocolError,
    RequestMessage,
    Result,
    SamplingParams,
    Submit,
    Token,
    WorkerEvent,
    Yield,
    Yielded,
    decode,
    encode,
)

LIMIT = 1 << 16


@pytest.mark.parametrize(("message", "kind"), [
    (Submit("r1", SamplingParams(max_tokens=5, seed=7), prompt="héllo", submitted_at=1.5), RequestMessage),
    (Submit("r2", SamplingParams(), messages=[ChatMessage("user", "hi")]), RequestMessage),
    (Cancel("r1"), RequestMessage),
    (Batch("b", [Submit("r1", SamplingParams(temperature=0.0), prompt="p")]), InboxMessage),
    (Cancel("r1"), InboxMessage),
    (Yield(["r1", "r2"]), InboxMessage),
    (Yielded("w1", "r1"), WorkerEvent),
    (Submit("r3", SamplingParams(), prompt="p", background=True, resume=[4, 5], yields=2), RequestMessage),
    (Token(3, "日本"), Result),
    (Done("length", 4, 20), Result),
    (Error("context_length_exceeded", "too long"), Result),
    (Finished("w1", "r1"), Finished),
    (Heartbeat("w1", "m", 8192, 16, 2, 0, 9, 1.0), Heartbeat),
])
def test_every_message_survives_a_round_trip(message: msgspec.Struct, kind: type) -> None:
    assert decode(encode(message, LIMIT), kind, LIMIT) == message


def test_a_message_over_the_limit_is_refused_on_both_sides() -> None:
    big = Submit("r", SamplingParams(), prompt="x" * 2000)
    with pytest.raises(ProtocolError, match="over the 1000-byte limit"):
        encode(big, 1000)
    with pytest.raises(ProtocolError, match="over the 1000-byte limit"):
        decode(encode(big, LIMIT), RequestMessage, 1000)


@pytest.mark.parametrize("data", [
    b"\xc1",                                                       # not msgpack at all
    msgspec.msgpack.encode([1, 2, 3]),                             # not a map
    msgspec.msgpack.encode({"type": "nope", "request_id": "r"}),   # unknown tag
    msgspec.msgpack.encode({"type": "cancel"}),                    # missing field
    msgspec.msgpack.encode({"type": "cancel", "request_id": 5}),   # wrong type
    encode(Token(1, "x"), LIMIT),                                  # a valid message of another kind
])
def test_malformed_messages_raise_a_clear_protocol_error(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="malformed message"):
        decode(data, RequestMessage, LIMIT)


def test_wire_format_is_msgpack_with_a_type_tag() -> None:
    raw = msgspec.msgpack.decode(encode(Token(2, "a"), LIMIT))
    assert raw == {"type": "token", "index": 2, "text": "a"}


def test_the_readme_error_table_lists_every_code_with_its_status() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("| case | status | `code` |\n", 1)[1].split("\n\n", 1)[0]
    rows = [line.split(" | ") for line in table.splitlines()[1:]]
    listed = {code: row[-2] for row in rows if len(row) >= 3 for code in re.findall(r"`([a-z_]+)`", row[-1])}
    for code in ErrorCode:
        assert code.value in listed, f"{code.value} is missing from the README's error table"
        assert str(code.status) in listed[code.value], f"{code.value}: README says {listed[code.value]!r}"
