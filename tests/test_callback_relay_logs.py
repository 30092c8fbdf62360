"""The callback relay with Redis away (issue 69): it logged a warning with a traceback every second for as long as
Redis was down. Now one line when Redis goes, one when it is back, no traceback for a known connection error; and it
relays again once Redis answers."""

from __future__ import annotations

import logging

import pytest
import redis

from contract.redis.keys import Keys
from tasks.callbacks.relay import OutboxRelay
from tests.support import RedisServer, wait_until

pytestmark = pytest.mark.integration  # its own redis-server

RETRY_S = 0.05


def test_redis_away_is_one_line_and_back_is_one_line(tmp_path, caplog):
    server = RedisServer(tmp_path)  # its own: the test stops it
    client = redis.Redis.from_url(server.url, socket_timeout=1, socket_connect_timeout=1)
    keys = Keys("relaylogs")
    sent: list[str] = []
    relay = OutboxRelay(client, keys, sent.append, retry_s=RETRY_S)
    caplog.set_level(logging.DEBUG, logger="tasks.callbacks.relay")
    relay.start()
    try:
        client.rpush(keys.callback_outbox, "before")
        client.publish(keys.callback_outbox, "ended")
        wait_until(lambda: sent == ["before"], 10, what="the relay to send the first callback")

        server.stop()
        # several tries while it is away (each a DEBUG line), so one WARNING is not just one try
        wait_until(lambda: len(_records(caplog, logging.DEBUG)) >= 3, 20, what="three tries with Redis away")
        server.start()
        wait_until(lambda: _records(caplog, logging.INFO), 20, what="the relay to say Redis is back")
        client.rpush(keys.callback_outbox, "after")
        client.publish(keys.callback_outbox, "ended")
        wait_until(lambda: sent == ["before", "after"], 10, what="the relay to send again")
    finally:
        relay.stop()
        server.stop()
    # the relay's own lines: a thread an earlier test left in this process (a job-event listener) may log too
    shown = [r for r in caplog.records if r.name == "tasks.callbacks.relay" and r.levelno >= logging.INFO]
    assert [(r.levelname, r.getMessage().split(" (")[0].split(",")[0]) for r in shown] == [
        ("WARNING", "callback relay: Redis unreachable"),
        ("INFO", "callback relay: Redis is back"),
    ], [r.getMessage() for r in shown]
    assert not any(record.exc_info for record in caplog.records)


def _records(caplog, level: int) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno == level and r.name == "tasks.callbacks.relay"]
