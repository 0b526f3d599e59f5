"""The nemesis soak (bench/nemesis.py) in short: two gateways, three ENGINE=sim workers, a leading and a standby
scheduler and Redis behind three sentinels (a primary and a replica with min-replicas-to-write 1), each its own
process, under closed-loop streaming clients that resume on the other gateway, while every fault of the nemesis
strikes at least once (kill -9 and SIGTERM of workers, gateways and the leading scheduler, a worker frozen past
its TTL, a Sentinel failover and kill -9 of the primary, clients that vanish, one worker's traffic to Redis
delayed, and cut off past its TTL). Its checker's verdicts: nothing lost, duplicated or run twice, every text equal
to the fault-free one, the vanished cancelled, no key left without a TTL and no slot held once the load has
stopped."""

from __future__ import annotations

import json

from bench.nemesis import FAULTS, Options, run, schedule, summary

# A round of every fault at 2.5-5 s gaps takes about 40 s: two rounds or so in the faulty phase, about 70 s.
CI = Options(minutes=1.2, seed=45, clients=8, warmup_s=5.0, gap_s=(2.5, 5.0), settle_s=180.0)


def test_the_schedule_is_the_seeds_and_strikes_every_fault() -> None:
    plan = schedule(CI)
    assert [(f.at_s, f.fault, f.target) for f in plan] == [(f.at_s, f.fault, f.target) for f in schedule(CI)]
    assert {f.fault for f in plan} == set(FAULTS)
    other = schedule(Options(minutes=CI.minutes, seed=CI.seed + 1, clients=CI.clients))
    assert [f.fault for f in plan] != [f.fault for f in other]


# What Redis' asynchronous replication may still drop (docs/faults.md, "Faults together"): a primary killed with
# kill -9 loses the writes it had not yet sent to its replica. The checker puts down to a failover what it explains
# (bench/nemesis.py EXPLAINED: a request whose trace lost its start, one that lived through a failover's window);
# the assignments such a loss would leave held are tolerated here as a whole. Anything else fails, a request a
# woken frozen or partitioned worker wrote to after it moved included (both fixed).
TOLERATED = {"held_after_settling"}


def test_faults_together_lose_duplicate_and_repeat_nothing() -> None:
    report = run(CI)
    print(summary(report))
    counts = report["counts"]
    assert set(report["faults_struck"]) == set(FAULTS), report["faults_struck"]
    assert counts["jobs_completed"] > 20, counts
    assert counts.get("jobs_vanished", 0) >= 1, counts
    failed = {name: value for name, value in report["verdicts_unexplained"].items() if value and name not in TOLERATED}
    # Each verdict names what it counts; the report's examples name the requests and their journeys.
    assert not failed, json.dumps({"unexplained": failed, "examples": report["examples"],
                                   "held": report["held_after_settling"], "left_behind": report["left_behind"]},
                                  indent=1)
