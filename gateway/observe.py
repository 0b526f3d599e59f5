"""Routes to watch the system: Prometheus metrics, the cluster at a glance, and the
journey of one request_id."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.errors import ApiError
from gateway.submits import bus_of

router = APIRouter()


@router.get("/metrics", summary="Prometheus metrics of this gateway")
async def prometheus_metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/cluster", summary="Live workers, queue depth and recent output tokens/s")
async def cluster(request: Request) -> dict[str, object]:
    bus = bus_of(request)
    workers = sorted(await bus.view.live_workers(), key=lambda w: w.worker_id)
    throughput = await bus.throughput.read()  # every gateway's, not only this one's
    return {
        "workers": [{"id": w.worker_id, "model": w.model, "names": w.serves(), "slots": w.slots,
                     "running": w.running, "waiting": w.waiting, "draining": w.draining} for w in workers],
        "queue": await bus.view.queue_depth(),
        "tokens_per_s": throughput.rate(),
        "history": throughput.history(),
    }


@router.get("/v1/requests/{request_id}/trace", summary="The ordered journey of one request across the services")
async def trace(request_id: str, request: Request) -> dict[str, object]:
    events = await bus_of(request).view.trace(request_id)
    if not events:
        raise ApiError(404, f"no trace for request '{request_id}' (unknown, or older than TRACE_TTL)",
                       "trace_not_found", "request_id")
    start = events[0].at
    timeline = []
    for previous, event in zip([None, *events], events, strict=False):
        timeline.append({"hop": event.hop, "service": event.service, "at": event.at,
                         "since_start_ms": round((event.at - start) * 1000, 3),
                         "since_previous_ms": round((event.at - previous.at) * 1000, 3) if previous else 0.0,
                         "detail": event.detail})
    return {"request_id": request_id, "total_ms": round((events[-1].at - start) * 1000, 3), "events": timeline}
