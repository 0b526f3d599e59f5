"""The scheduler's Prometheus metrics, served on SCHEDULER_METRICS_PORT."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

WAITING = Gauge("llmserve_scheduler_waiting", "Requests waiting for a worker")
WORKERS = Gauge("llmserve_scheduler_live_workers", "Workers with a live heartbeat")
FREE_SLOTS = Gauge("llmserve_scheduler_free_slots", "Free slots over all live workers")
DISPATCH_LATENCY = Histogram("llmserve_scheduler_dispatch_latency_seconds",
                             "From the gateway accepting a request to its dispatch to a worker",
                             buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120))
WAITING_BY_PRIORITY = Gauge("llmserve_scheduler_waiting_by_priority",
                            "Requests waiting for a worker, by priority class: urgent (< 0), default (0), low (> 0), "
                            "background (batch jobs' lines)", ["priority"])
QUEUE_WAIT = Histogram("llmserve_scheduler_queue_wait_seconds",
                       "From the gateway accepting a request to its dispatch, by priority class", ["priority"],
                       buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 120, 600, 3600))
DISPATCHED = Counter("llmserve_scheduler_dispatched_total", "Requests sent to workers")
BATCHES = Counter("llmserve_scheduler_batches_total", "Batches sent to workers")
MIGRATIONS = Counter("llmserve_scheduler_migrations_total", "Requests moved off a lost worker")
QUEUE_TIMEOUTS = Counter("llmserve_scheduler_queue_timeouts_total", "Requests dropped after their queue deadline")
LINES_YIELDED = Counter("llmserve_scheduler_lines_yielded_total",
                        "Batch lines that handed their slot back to interactive requests, queued again")
UNHELD = Counter("llmserve_scheduler_unheld_total",
                 "Assignments their live worker reported it did not hold (a Batch or an ending lost in a Redis "
                 "failover): moved on, or released where they had ended")
MIGRATION_FAILURES = Counter("llmserve_scheduler_migration_limit_total", "Requests failed past the migration limit")
WORKERS_LOST = Counter("llmserve_scheduler_workers_lost_total", "Workers gone with requests in flight")
FAILED = Counter("llmserve_scheduler_failed_total", "Requests the scheduler ended with an error", ["code"])
DEAD_LETTERS = Counter("llmserve_scheduler_dead_letters_total",
                       "Requests set aside after they failed the scheduler (also counted in failed_total)")
