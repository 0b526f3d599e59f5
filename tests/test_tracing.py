"""OpenTelemetry (the `otel` extra, on when an OTLP endpoint is set): each hop of a request's journey is a
span of one trace (the gateway's, a child of the client's traceparent, and the scheduler's and the worker's
under it), exported over OTLP/HTTP to a receiver the test runs; the response returns the gateway span's
traceparent. Off by default: no header, no export. The stack runs ENGINE=sim workers: the spans are the
control plane's, the same code for either engine."""

from __future__ import annotations

import http.server
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from common.settings import SettingsError
from common.tracing import Tracing
from harness.stacks import PrivateStack
from llmserve.processes import free_port
from tests.conftest import RunningStack, sim_stack

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver(http.server.ThreadingHTTPServer):
    """An OTLP/HTTP trace receiver: every span it is sent, with its service's name."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), Handler)
        self.spans: list[tuple[str, object]] = []


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest.FromString(body)
        for resource in export.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            for scope in resource.scope_spans:
                self.server.spans += [(service, span) for span in scope.spans]
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def traced() -> Iterator[tuple[PrivateStack, Receiver]]:
    receiver = Receiver()
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    settings = {"SIM_STEP_MS": "5", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.server_address[1]}",
                "OTEL_BSP_SCHEDULE_DELAY": "100", "NAMESPACE": "traced"}
    try:
        with sim_stack(1, **settings) as stack:
            yield stack, receiver
    finally:
        receiver.shutdown()


def spans_of(receiver: Receiver, trace_id: str, services: int = 3) -> dict[str, object]:
    """The spans of one trace by service, once every service's has arrived."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        found = {service: span for service, span in list(receiver.spans) if span.trace_id.hex() == trace_id}
        if len(found) >= services:
            return found
        time.sleep(0.1)
    raise AssertionError(f"spans of {trace_id}: {found}")


def attributes(span: object) -> dict[str, object]:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def test_every_hop_is_a_span_of_the_clients_trace(traced: tuple[PrivateStack, Receiver]) -> None:
    stack, receiver = traced
    body = {"model": "sim", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    response = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30,
                          headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert response.status_code == 200, response.text
    version, trace_id, span_id, _ = response.headers["traceparent"].split("-")
    assert (version, trace_id) == ("00", CLIENT_TRACE) and span_id != CLIENT_SPAN
    spans = spans_of(receiver, CLIENT_TRACE)
    gateway, queue, generate = spans["llmserve-gateway"], spans["llmserve-scheduler"], spans["llmserve-worker"]
    assert gateway.name == "POST /v1/chat/completions" and gateway.parent_span_id.hex() == CLIENT_SPAN
    assert gateway.span_id.hex() == span_id
    assert queue.name == "llmserve.queue" and generate.name == "llmserve.generate"
    assert queue.parent_span_id == generate.parent_span_id == gateway.span_id
    request_id = response.headers["x-request-id"]
    assert attributes(gateway)["llmserve.request_id"] == request_id
    assert attributes(queue)["llmserve.request_id"] == attributes(generate)["llmserve.request_id"] == request_id
    assert attributes(generate)["llmserve.outcome"] == "finished" and attributes(generate)["llmserve.tokens"] == 4
    assert [event.name for event in generate.events] == ["first_token"]
    assert gateway.start_time_unix_nano <= queue.start_time_unix_nano <= queue.end_time_unix_nano \
        <= generate.end_time_unix_nano <= gateway.end_time_unix_nano


def test_a_stream_without_a_traceparent_starts_a_trace_of_its_own(traced: tuple[PrivateStack, Receiver]) -> None:
    stack, receiver = traced
    with httpx.stream("POST", f"{stack.url}/generate_stream", json={"prompt": "one two", "max_tokens": 3},
                      timeout=30) as response:
        trace_id = response.headers["traceparent"].split("-")[1]
        response.read()
    spans = spans_of(receiver, trace_id)
    assert spans["llmserve-gateway"].parent_span_id == b""
    assert spans["llmserve-worker"].parent_span_id == spans["llmserve-gateway"].span_id


def test_off_by_default_and_a_missing_extra_is_named_at_start(stack: RunningStack,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    answer = httpx.post(f"{stack.url}/generate", json={"prompt": "hi", "max_tokens": 1}, timeout=60)
    assert answer.status_code == 200 and "traceparent" not in answer.headers
    assert not Tracing("gateway", {}).enabled
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if the otel extra were not installed
    with pytest.raises(SettingsError, match="OTEL_EXPORTER_OTLP_ENDPOINT"):
        Tracing("gateway", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
