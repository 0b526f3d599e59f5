"""The gateway's Redis and the parts that share it: admission (gateway/admission.py), the ledger of streams'
logs and ends (gateway/ledger.py), the cluster view the routes read (gateway/cluster_view.py), the router of
results to streams (gateway/mailbox.py's Router) and the streams' leases (gateway/leases.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from common.clients import async_client, is_cluster, parse_redis_url
from common.keys import Keys
from common.protocol import Detokenize, Tokenize
from common.settings import GatewaySettings
from common.streams import StreamWriter
from gateway.admission import Admission
from gateway.cluster_view import ClusterView
from gateway.leases import Leases
from gateway.ledger import Ledger
from gateway.mailbox import Router
from gateway.results import ResultRouter
from gateway.shards import ShardedRouter
from gateway.throughput import SharedThroughput

POOL_CONNECTIONS = 64
POOL_WAIT_SECONDS = 30.0


class Bus:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.limit = settings.max_message_bytes
        self.keys = Keys(settings.namespace)
        self.streams = StreamWriter(self.keys, self.limit)
        # A burst of a thousand arrivals waits its turn for a connection instead of failing with
        # "Too many connections"; each command holds one for well under a millisecond.
        self.redis = async_client(settings.redis_url, POOL_CONNECTIONS, POOL_WAIT_SECONDS)
        self.cluster = is_cluster(settings.redis_url)
        self.router: Router = (
            ShardedRouter(self.redis, parse_redis_url(settings.redis_url), self.keys, self.limit,
                          settings.client_buffer_bytes) if self.cluster
            else ResultRouter(settings.redis_url, self.keys, self.limit, settings.client_buffer_bytes))
        self.leases = Leases(self.redis, self.keys, settings, lambda heads: self.ledger.lapsed(heads))
        self.admission = Admission(self.redis, self.keys, settings, self.leases, self.cluster)
        self.ledger = Ledger(self.redis, self.keys, settings, self.leases)
        self.view = ClusterView(self.redis, self.keys, self.limit)
        self.throughput = SharedThroughput(self.redis, self.keys)
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await self.router.start()
        self.leases.start()
        self.throughput.start()

    async def ping(self) -> None:
        """Raises unless Redis answers (in a cluster, also while a node is known to be unreachable)."""
        await self.redis.ping()
        self.router.check()

    async def stop(self) -> None:
        await self.leases.stop()
        await self.throughput.stop()
        await self.router.stop()
        await self.redis.aclose()

    def soon(self, work: Awaitable[None]) -> None:
        """Run `work` in the background (from a callback that cannot wait), keeping a reference to it."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def tell(self, worker_id: str, message: Tokenize | Detokenize) -> None:
        """A question for one worker (not a request: the scheduler has no part in it), into its inbox."""
        pipe = self.redis.pipeline(transaction=False)
        self.streams.inbox(pipe, worker_id, message)
        await pipe.execute()
