"""The nemesis soak (bench/nemesis.py) in short: two gateways, three ENGINE=sim workers, a leading and a standby
scheduler and Redis behind three sentinels (a primary and a replica with min-replicas-to-write 1), each its own
process, under closed-loop streaming clients that resume on the other gateway, while every fault of the nemesis
strikes for 2 minutes, each at least once (kill -9 and SIGTERM of workers, gateways and the leading scheduler, a
worker frozen past its TTL, a Sentinel failover and kill -9 of the primary, clients that vanish, one worker's
traffic to Redis delayed, and cut off past its TTL). Its checker's verdicts, every one 0 with nothing excused:
nothing lost, duplicated or run twice, every text equal to the fault-free one, the vanished cancelled, no key left
without a TTL, no slot held once the load has stopped, no process's memory grown past its service's bound."""

from __future__ import annotations

import json

from bench.nemesis import FAULTS, Options, run, schedule, summary

# A round of every fault at 2.5-5 s gaps takes about 45 s: about three rounds in the 2 minutes of faults.
CI = Options(minutes=2.0, seed=45, clients=8, warmup_s=5.0, gap_s=(2.5, 5.0), settle_s=180.0)


def test_the_schedule_is_the_seeds_and_strikes_every_fault() -> None:
    plan = schedule(CI)
    assert [(f.at_s, f.fault, f.target) for f in plan] == [(f.at_s, f.fault, f.target) for f in schedule(CI)]
    assert {f.fault for f in plan} == set(FAULTS)
    other = schedule(Options(minutes=CI.minutes, seed=CI.seed + 1, clients=CI.clients))
    assert [f.fault for f in plan] != [f.fault for f in other]


def test_faults_together_lose_duplicate_and_repeat_nothing() -> None:
    report = run(CI)
    print(summary(report))
    counts = report["counts"]
    assert set(report["faults_struck"]) == set(FAULTS), report["faults_struck"]
    assert counts["jobs_completed"] > 20, counts
    assert counts.get("jobs_vanished", 0) >= 1, counts
    # Nothing excused: with min-replicas-to-write 1, a failover's old primary refuses the writes its demotion would
    # drop, so a request that lived through a failover answers for itself like any other. Each verdict names what it
    # counts; the report's examples name the requests and their journeys.
    verdicts = report["verdicts"]
    assert verdicts["ok"], json.dumps({"verdicts": verdicts, "explained": report["verdicts_explained"],
                                       "examples": report["examples"], "held": report["held_after_settling"],
                                       "left_behind": report["left_behind"], "memory_grew": report["memory_grew"]},
                                      indent=1)
