"""`llmserve up | status | bench | quota | gateway | scheduler | worker`."""

from __future__ import annotations

import argparse
import os

from common.settings import SettingsError
from llmserve.loadgen.run import add_arguments as add_bench_arguments
from llmserve.loadgen.run import main as run_bench


def _count(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return number


def _workers(value: str) -> int | dict[str, int]:
    from llmserve.launcher import worker_counts

    try:
        return worker_counts(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> None:
    parser = argparse.ArgumentParser(prog="llmserve", description="LLM serving over a Redis message bus.")
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start Redis (if needed), the gateway, a scheduler and workers")
    up.add_argument("--workers", type=_workers, default=1, metavar="N | MODEL=N,...",
                    help="number of worker processes (default 1), or a number per model: each such worker loads "
                         "and answers to its MODEL")
    up.add_argument("--gateways", type=_count, default=1,
                    help="number of gateway processes, on consecutive ports from GATEWAY_PORT (default 1)")
    status = commands.add_parser("status", help="workers, slots, queue and recent throughput, as a table")
    status.add_argument("--url", default=f"http://localhost:{os.environ.get('GATEWAY_PORT', '8000')}",
                        help="the gateway (default http://localhost:$GATEWAY_PORT)")
    bench = commands.add_parser("bench", help="load-test this or any OpenAI-compatible server",
                                description="Fixed concurrency or Poisson arrivals; TTFT, ITL, end-to-end "
                                            "latency and throughput per load level; JSON and a PNG plot.")
    add_bench_arguments(bench)
    quota = commands.add_parser("quota", help="an API key's own requests and tokens per minute (in Redis)")
    quota.add_argument("key", help="one of API_KEYS")
    quota.add_argument("--rpm", type=int, help="requests per minute (0: unlimited)")
    quota.add_argument("--tpm", type=int, help="prompt and completion tokens per minute (0: unlimited)")
    quota.add_argument("--priority-floor", type=int, help="the lowest priority the key's requests run at (a request "
                       "asking for a lower one, which would run sooner, runs at this)")
    quota.add_argument("--clear", action="store_true", help="back to KEY_RPM and KEY_TPM, and no priority floor")
    commands.add_parser("gateway", help="run the HTTP gateway")
    commands.add_parser("scheduler", help="run the scheduler")
    commands.add_parser("worker", help="run one model worker")
    args = parser.parse_args()

    # Each service imports only its own dependencies: the gateway image has no torch.
    if args.command == "up":
        from llmserve.launcher import up as run_stack

        raise SystemExit(run_stack(args.workers, args.gateways))
    if args.command == "status":
        from llmserve.status import status as show_status

        raise SystemExit(show_status(args.url))
    if args.command == "bench":
        raise SystemExit(run_bench(args))
    if args.command == "quota":
        from llmserve.quota import quota as set_quota

        if any(v is not None and v < 0 for v in (args.rpm, args.tpm)):
            raise SystemExit("llmserve quota: --rpm and --tpm must not be negative")
        if args.priority_floor is not None and abs(args.priority_floor) >= 2**31:
            raise SystemExit("llmserve quota: --priority-floor must be within a 32-bit integer, as priorities are")
        print(set_quota(args.key, args.rpm, args.tpm, args.clear, priority_floor=args.priority_floor))
        return
    if args.command == "gateway":
        from gateway.app import main as run
    elif args.command == "scheduler":
        from scheduler.main import main as run
    else:
        from worker.main import main as run
    try:
        run()
    except SettingsError as exc:
        # A bad setting is the operator's to fix: say which, and exit with a distinct status.
        raise SystemExit(f"llmserve {args.command}: {exc}") from None


if __name__ == "__main__":
    main()
