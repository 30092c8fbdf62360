"""Kombu's Redis transport, keeping one synchronous Redis client per channel.

Kombu builds a new redis-py client for every synchronous operation (each
publish, each ack, each event flush): a client's constructor copies ~170
response callbacks, about a quarter of a millisecond, several times per task
in the CPU worker's main process and once per submission in the API. A client
holds no connection of its own (it borrows one from the channel's pool per
command), so one per channel serves every operation. The asynchronous client
(the consumer's BRPOP, which keeps its connection) is left as kombu makes it.
"""
from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis

# Named in the Celery app's `broker_transport`; the broker URL stays redis://.
TRANSPORT = "tasks.broker:Transport"


class Channel(kombu_redis.Channel):
    _sync_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._sync_client
        if client is None or client.connection_pool is not self.pool:   # a reconnect makes a new pool
            client = self._sync_client = super()._create_client(asynchronous=False)
        return client


class Transport(kombu_redis.Transport):
    Channel = Channel
