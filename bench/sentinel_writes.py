"""What a Sentinel failover does to writes a client was told succeeded, by how the Redis group is run: one
client (the services' own, common/clients.py) appends numbers as fast as it can to a list; `SENTINEL FAILOVER`
strikes; then the list on the new primary is read. For each group: the writes acknowledged, those lost (told
done, then gone), and the longest pause between two acknowledged writes (how long writes were refused).

An old primary goes on answering until Sentinel demotes it, about 10 s after the failover. Without
`min-replicas-to-write` it takes writes all that while, and its demotion drops them; with it, it refuses them
(NOREPLICAS) as soon as too few replicas follow it, and the client asks Sentinel again. What is left is the
time between the promotion of one replica and Sentinel moving the others over, during which they still follow
the old primary and count for it. Prints a table and writes bench/results/sentinel_writes-<host kind>.json."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance, write_results  # noqa: E402
from common.clients import sync_client  # noqa: E402
from common.runtime import REDIS_ERRORS, redis_trouble  # noqa: E402
from harness.topology import start_sentinel  # noqa: E402
from llmserve.processes import wait_until  # noqa: E402

# (replicas, min-replicas-to-write) of each group measured.
GROUPS = ((1, 0), (1, 1), (2, 1), (2, 0))
# Past the old primary's demotion, so that what it dropped is gone by the time the list is read.
AFTER_S = 14.0


def through_failover(replicas: int, write_replicas: int, after_s: float = AFTER_S) -> dict[str, object]:
    group = start_sentinel(replicas=replicas, write_replicas=write_replicas)
    try:
        client = sync_client(group.url, socket_timeout=2, socket_connect_timeout=2)
        acked: list[tuple[int, float]] = []
        refusals: list[str] = []
        unexpected: list[str] = []
        stop = threading.Event()

        def write() -> None:
            value = 0
            while not stop.is_set():
                try:
                    client.rpush("acked", value)
                except REDIS_ERRORS as exc:
                    (refusals if redis_trouble(exc) else unexpected).append(str(exc)[:120])
                    if unexpected:
                        return
                    time.sleep(0.02)
                    continue
                acked.append((value, time.monotonic()))
                value += 1
                time.sleep(0.005)

        writer = threading.Thread(target=write)
        writer.start()
        wait_until(lambda: len(acked) > 50, 10, "writes under way")
        # A replica fresh from its first sync gets the writes a moment after the primary takes them.
        wait_until(group.ready, 10, "the replica following the writes")
        struck = time.monotonic()
        group.failover()
        time.sleep(after_s)
        stop.set()
        writer.join(10)
        kept = {int(v) for v in sync_client(group.url).lrange("acked", 0, -1)}
    finally:
        group.stop()
    pauses = [later - earlier for (_, earlier), (_, later) in itertools.pairwise(acked)]
    lost = [round(at - struck, 3) for value, at in acked if value not in kept]
    return {"replicas": replicas, "min_replicas_to_write": write_replicas, "acknowledged": len(acked),
            "lost": len(lost), "lost_acknowledged_from_s": lost[0] if lost else None,
            "lost_acknowledged_to_s": lost[-1] if lost else None, "longest_pause_s": round(max(pauses), 2),
            "refused_writes": len(refusals), "refusal": refusals[0] if refusals else "", "unexpected": unexpected}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out")
    args = parser.parse_args()
    started = provenance()
    rows = []
    for replicas, write_replicas in GROUPS:
        rows.append(through_failover(replicas, write_replicas))
        print(json.dumps(rows[-1]), flush=True)
    print("replicas | min-replicas-to-write | acknowledged | lost | longest pause")
    for row in rows:
        print(f"{row['replicas']} | {row['min_replicas_to_write']} | {row['acknowledged']} | {row['lost']} | "
              f"{row['longest_pause_s']} s")
    print(write_results("sentinel_writes", started, {"after_s": AFTER_S, "groups": rows}, args.out))


if __name__ == "__main__":
    main()
