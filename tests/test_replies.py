"""contract.redis.replies: payload replies read straight from the socket, against a real Redis."""

from __future__ import annotations

import os

import pytest
import redis

from contract.redis.replies import PayloadReader


def test_every_kind_of_reply_in_one_round_trip_and_the_connection_stays_in_step(redis_client):
    big = os.urandom(3 * 1024 * 1024 + 17)  # many socket reads, not a multiple of any buffer
    redis_client.set("replies:big", big)
    redis_client.hset("replies:hash", mapping={"a": "1", "b": "two"})
    reader = PayloadReader(redis_client)
    payload, missing, fields, count, pong, wrong, after = reader.execute(
        ("GET", "replies:big"),
        ("GET", "replies:none"),
        ("HGETALL", "replies:hash"),
        ("INCR", "replies:n"),
        ("PING",),
        ("LPUSH", "replies:hash", "x"),
        ("STRLEN", "replies:big"),
    )
    assert isinstance(payload, memoryview) and payload == big and missing is None
    assert dict(zip(fields[::2], fields[1::2])) == {b"a": b"1", b"b": b"two"}
    assert (count, pong, after) == (1, b"PONG", len(big))
    assert isinstance(wrong, redis.ResponseError) and "WRONGTYPE" in str(wrong)
    assert reader.execute(("GET", "replies:none"), ("ECHO", "still in step")) == [None, b"still in step"]
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        reader.bulks(("LPOP", "replies:hash"))
    assert reader.bulks(("GET", "replies:big"))[0] == big


def test_a_connection_that_dies_mid_reply_is_dropped_and_the_next_call_reconnects(redis_client):
    redis_client.set("replies:big", b"x" * 100_000)
    reader = PayloadReader(redis_client)
    assert reader.bulks(("GET", "replies:big"))[0] == b"x" * 100_000
    reader.connection._sock.close()  # the socket goes away under the reader
    with pytest.raises(redis.ConnectionError):
        reader.execute(("GET", "replies:big"))
    assert reader.bulks(("GET", "replies:big"))[0] == b"x" * 100_000
