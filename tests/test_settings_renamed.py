"""Settings that moved keep their old names for one release (docs/upgrading.md): `api.redis_timeout_s` is read as
`redis.timeout_s`, from a file or the environment, with a warning naming the new one; the Redis connections read it
from the `redis` section."""

from __future__ import annotations

import pytest
import yaml

from contract.redis.connection import connect, sentinels_of
from contract.settings.config import load_settings


def test_the_redis_timeout_is_a_redis_setting_and_every_connection_reads_it(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"redis": {"timeout_s": 0.75, "sentinels": ["127.0.0.1:26379"]}}))
    settings = load_settings(path)
    assert settings.redis.timeout_s == 0.75
    assert not hasattr(settings.api, "redis_timeout_s")
    plain = connect(load_settings(), max_connections=2)  # lazy: nothing is connected to build it
    assert plain.connection_pool.connection_kwargs["socket_connect_timeout"] == load_settings().redis.timeout_s
    assert plain.connection_pool.timeout == load_settings().redis.timeout_s  # the wait for a free connection
    sentinel = sentinels_of(settings.redis).sentinels[0].connection_pool.connection_kwargs
    assert (sentinel["socket_connect_timeout"], sentinel["socket_timeout"]) == (0.75, 0.75)


def test_the_old_name_in_a_file_is_read_as_the_new_one_with_a_warning(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"api": {"redis_timeout_s": 0.5, "workers": 3}}))
    with pytest.warns(FutureWarning, match=r"api.redis_timeout_s \(.*config.yaml\) is deprecated.*set redis.timeout_s"):
        settings = load_settings(path)
    assert (settings.redis.timeout_s, settings.api.workers) == (0.5, 3)


def test_the_old_environment_variable_is_read_as_the_new_one_and_a_later_layer_wins(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"redis": {"timeout_s": 0.5}}))
    monkeypatch.setenv("IMGSERVE_API__REDIS_TIMEOUT_S", "1.5")
    with pytest.warns(FutureWarning, match=r"the environment.*IMGSERVE_REDIS__TIMEOUT_S"):
        settings = load_settings(path)
    assert settings.redis.timeout_s == 1.5  # the environment over the file, as for any setting


def test_where_one_layer_gives_both_names_the_new_one_stands(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"api": {"redis_timeout_s": 9.0}, "redis": {"timeout_s": 0.25}}))
    with pytest.warns(FutureWarning):
        assert load_settings(path).redis.timeout_s == 0.25


def test_the_hit_bucket_is_every_answers_bucket_now_and_its_old_name_is_read_with_a_warning(tmp_path, monkeypatch):
    """`cache.hit_bytes_per_key` bounds computed answers too since issue 70: `jobs.answer_bytes_per_key`."""
    from contract.jobs.hits import HitLimits

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"cache": {"hit_bytes_per_key": 4096, "ttl_s": 60}}))
    with pytest.warns(FutureWarning, match=r"cache.hit_bytes_per_key .*set jobs.answer_bytes_per_key"):
        settings = load_settings(path)
    assert (settings.jobs.answer_bytes_per_key, settings.cache.ttl_s) == (4096, 60)
    assert not hasattr(settings.cache, "hit_bytes_per_key")
    assert HitLimits.of(settings).bucket_bytes == 4096
    monkeypatch.setenv("IMGSERVE_CACHE__HIT_BYTES_PER_KEY", "8192")
    with pytest.warns(FutureWarning, match=r"IMGSERVE_JOBS__ANSWER_BYTES_PER_KEY"):
        assert load_settings(path).jobs.answer_bytes_per_key == 8192
