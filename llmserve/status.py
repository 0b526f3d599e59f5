"""`llmserve status`: the cluster at a glance in the terminal, from the gateway's /v1/cluster."""

from __future__ import annotations

import os

import httpx


def render(cluster: dict) -> str:
    rows = [("worker", "model", "running", "free", "waiting", "state")]
    for w in cluster["workers"]:
        rows.append((w["id"], w["model"], str(w["running"]), str(w["slots"] - w["running"]), str(w["waiting"]),
                     "draining" if w["draining"] else "serving"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    recent = [rate for _, rate in cluster["history"][-12:]]
    lines += ["", f"workers: {len(cluster['workers'])}   queue: {cluster['queue']}   "
                  f"tokens/s (10 s): {cluster['tokens_per_s']:.1f}   "
                  f"tokens/s (last minute, 5 s steps): {' '.join(f'{r:.0f}' for r in recent)}"]
    return "\n".join(lines)


def status(url: str) -> int:
    keys = [k.strip() for k in os.environ.get("API_KEYS", "").split(",") if k.strip()]
    headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/cluster", headers=headers, timeout=10)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"llmserve status: cannot read {url}/v1/cluster: {exc}")
        return 1
    print(render(response.json()))
    return 0
