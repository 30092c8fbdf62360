"""Bench building blocks that need no running stack: the simulated device,
busy metering, time-bill summaries, the report and the story's readings."""

from __future__ import annotations

import numpy as np
import pytest

from bench.load.client import Outcome
from bench.load.diagnose import band, pattern
from bench.load.report import markdown, summarise
from contract.frames import unpack_frame
from contract.jobs.timebill import percentile, summarise_bills
from contract.settings import STORY_PROFILE_MS
from contract.settings.models import ModelSpec
from gpu_worker.simulated import SimulatedDevice, profile_latency_s
from gpu_worker.stats import BusyMeter
from tests.test_gpu_worker_parts import make_frame


@pytest.mark.parametrize("batch,ms", [(1, 72), (4, 150), (8, 260), (16, 430), (2, 98), (12, 345), (32, 770)])
def test_profile_is_the_story_table_interpolated(batch, ms):
    assert profile_latency_s(STORY_PROFILE_MS, batch) * 1000 == pytest.approx(ms)


def test_simulated_device_spends_the_profile_latency_and_answers_inside_each_image(monkeypatch):
    slept = []
    monkeypatch.setattr("gpu_worker.simulated.time.sleep", slept.append)
    spec = ModelSpec(name="m", version="1", labels=("a", "b", "c"), input_size=64)
    device = SimulatedDevice(spec, STORY_PROFILE_MS, max_batch=8, slots=1)
    sizes = [(64, 48), (30, 64)] * 4
    frames = [unpack_frame(make_frame(f"j{i}", w, h, 0, 0)) for i, (w, h) in enumerate(sizes)]
    output = device.run(device.stage(frames))
    assert sum(slept) == pytest.approx(0.260, abs=0.01)  # the device's work is inside the latency
    assert output.device_s == pytest.approx(0.260)
    image = output.detections[:, 0].astype(int)
    assert sorted(set(image)) == list(range(8)) and (image == sorted(image)).all()
    widths = np.array([w for w, _ in sizes])[image]
    heights = np.array([h for _, h in sizes])[image]
    boxes = output.detections[:, 1:5]
    assert (boxes >= 0).all() and (boxes[:, 2] <= widths).all() and (boxes[:, 3] <= heights).all()
    assert (boxes[:, 0] < boxes[:, 2]).all() and (output.detections[:, 5] >= 0.6).all()
    device.run(device.stage(frames))  # its one slot came back


def test_simulated_device_honours_each_jobs_conf_and_max_det(monkeypatch):
    monkeypatch.setattr("gpu_worker.simulated.time.sleep", lambda _: None)
    spec = ModelSpec(name="m", version="1", labels=("a",), input_size=64)
    device = SimulatedDevice(spec, {1: 1.0}, max_batch=3)
    frames = [
        unpack_frame(make_frame("a", 8, 8, 0, 0, options={"max_det": 1})),
        unpack_frame(make_frame("b", 8, 8, 0, 0, options={"conf": 0.95})),
        unpack_frame(make_frame("c", 8, 8, 0, 0)),
    ]
    image = device.run(device.stage(frames)).detections[:, 0].astype(int).tolist()
    assert image.count(0) == 1 and image.count(1) == 0 and image.count(2) == 4


def test_busy_meter_counts_only_the_window():
    clock = [100.0]
    meter = BusyMeter(window_s=10.0, clock=lambda: clock[0])
    clock[0] = 120.0
    meter.record(105.0, 108.0)  # entirely outside the last 10 s
    meter.record(112.0, 115.0)
    meter.record(118.0, 119.0)
    assert meter.fraction(now=120.0) == pytest.approx(0.4)
    assert meter.total_s == pytest.approx(7.0)


def test_time_bill_summary_gives_percentiles_and_shares():
    bills = [{"infer": float(i), "decode": 1.0, "total": float(i) + 1.0} for i in range(1, 101)]
    summary = summarise_bills(bills)
    assert summary["infer"]["p50"] == pytest.approx(50.5)
    assert summary["infer"]["p95"] == pytest.approx(95.05)
    assert summary["infer"]["share"] == pytest.approx(50.5 / 51.5, rel=1e-3)
    assert percentile([1.0, 2.0, 3.0], 50) == 2.0


def outcome(start: float, latency: float, batch_id: str, size: int) -> Outcome:
    doc = {
        "status": "succeeded",
        "batch": {"id": batch_id, "size": size},
        "timings_ms": {"infer": 10.0, "total": latency * 1000},
    }
    return Outcome(start, start + latency, "succeeded", None, doc)


def test_report_counts_batches_once_and_busy_from_counters():
    outcomes = [
        outcome(0.0, 0.5, "b1", 2),
        outcome(0.1, 0.5, "b1", 2),
        outcome(0.5, 1.5, "b2", 1),
        Outcome(0.2, 0.3, "rejected", "http_429"),
    ]
    result = summarise(
        "p",
        "open",
        outcomes,
        2.0,
        None,
        {"device_seconds": 1.0, "wall": 10.0},
        {"device_seconds": 2.0, "wall": 14.0, "workers": 1, "simulated": True},
    )
    assert result["succeeded"] == 3 and result["achieved_qps"] == pytest.approx(1.5)
    assert result["batch_size_mean"] == 1.5 and result["batch_size_histogram"] == {1: 1, 2: 1}
    assert result["gpu_busy"] == 0.25 and result["failures"] == {"rejected:http_429": 1}
    text = markdown([result])
    assert "simulated accelerator" in text and "| p | open |" in text and "result cache" not in text
    repeated = {
        **result,
        "repeat_share": 0.9,
        "cache_hits": 2,
        "cache_hit_cost": {"hit_ms": 3.75, "hit_over_miss": 0.15},
        "cache_hit_ms": {"p50": 8.0, "p95": 12.0},
        "cache_hit_poll_ms": {"p50": 1.5, "p95": 2.5, "polls": 2},
        "cache_hit_poll_api_ms": {"p50": 0.5, "p95": 0.9, "polls": 2},
    }
    assert "| 90% | 2 of 3 | 3.75 | 0.15 | 8.00 / 12.00 | 1.50 / 2.50 | 0.50 / 0.90 |" in markdown([result, repeated])


def test_the_apis_own_time_is_read_from_server_timing():
    from bench.load.client import server_timing_ms

    assert server_timing_ms("app;dur=1.23") == 1.23
    assert server_timing_ms('db;dur=4, app;desc="api";dur="0.5"') == 0.5
    assert server_timing_ms("db;dur=4") is None and server_timing_ms("") is None
    assert server_timing_ms("app;dur=soon") is None


def run(concurrency: int, qps: float, p95: float, busy: float) -> dict:
    return {"concurrency": concurrency, "achieved_qps": qps, "latency_ms": {"p95": p95}, "gpu_busy": busy}


def test_the_story_reading_of_a_sweep():
    assert "serial" in pattern([run(1, 1.6, 617, 0.12), run(32, 1.6, 3100, 0.12)])
    assert "lock or I/O" in pattern([run(1, 1.6, 617, 0.12), run(32, 1.7, 3100, 0.5)])
    assert "scales" in pattern([run(1, 5.0, 200, 0.3), run(32, 25.0, 600, 0.8)])


@pytest.mark.parametrize(
    "busy,words", [(0.12, "outside the GPU"), (0.4, "batching"), (0.67, "healthy"), (0.95, "tail latency")]
)
def test_utilisation_bands(busy, words):
    assert words in band(busy)


def test_the_ideal_bound_batches_greedily_and_obeys_the_profile():
    from bench.meters.bound import ideal_latencies

    light, light_busy = ideal_latencies(STORY_PROFILE_MS, qps=1.0, window_s=0.012, max_batch=8, duration_s=600)
    assert percentile(light, 50) == pytest.approx(0.012 + 0.072, abs=0.002)  # alone: window + batch of 1
    heavy, heavy_busy = ideal_latencies(STORY_PROFILE_MS, qps=28.0, window_s=0.012, max_batch=8, duration_s=600)
    assert light_busy < 0.1 < 0.85 < heavy_busy < 1.0
    assert percentile(heavy, 95) > percentile(light, 95)


@pytest.mark.parametrize(
    "cmdline,role",
    [
        ("/v/bin/python -m gunicorn -c configs/gunicorn.conf.py app:create_app()", "api"),
        ("/v/bin/python3 /v/bin/celery -A tasks.worker worker -Q preprocess --concurrency=2", "cpu-worker"),
        ("/v/bin/celery -A tasks.worker worker -Q callbacks -P threads", "callback-worker"),
        ("/v/bin/celery -A tasks.worker flower --address=127.0.0.1 --port=5555", "flower"),
        ("/v/bin/celery -A tasks.flower flower --address=127.0.0.1 --port=5555", "flower"),
        ("/v/bin/python -m gpu_worker --metrics-port 9100", "gpu-worker"),
        ("redis-server 127.0.0.1:6379", "redis"),
        ("/usr/bin/vim notes", None),
    ],
)
def test_processes_are_given_their_role_by_command_line(cmdline, role):
    from bench.stack.cpu import role_of

    assert role_of(cmdline) == role
    assert role_of("redis-server 127.0.0.1:6379", redis_port=6380) is None


def test_cpu_per_image_counts_a_roles_children_and_what_was_born_during_the_run():
    import subprocess
    import sys

    from bench.stack.cpu import ms_per_image, sample

    burn = "import time\nend = time.process_time() + 2.0\nwhile time.process_time() < end: pass\n"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}]); input()",
            "-m gpu_worker",
        ],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        before = sample(sessions={parent.pid})
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            table = ms_per_image(before, sample(sessions={parent.pid}), 10)
            if table.get("gpu-worker", 0) >= 25:
                break
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
    assert table["gpu-worker"] >= 25 and table["stack"] >= table["gpu-worker"]  # 250 ms or more over 10 images


def test_the_stack_is_also_given_in_units_of_the_load_generators_own_cpu():
    from bench.stack.cpu import CpuSample, ms_per_image

    before = CpuSample({1: ("api", 1.0), 2: ("cpu-worker", 2.0), 3: ("bench", 0.5)})
    after = CpuSample({1: ("api", 1.3), 2: ("cpu-worker", 2.9), 3: ("bench", 0.6), 4: ("flower", 0.1)})
    table = ms_per_image(before, after, 100)
    assert table == {"api": 3.0, "cpu-worker": 9.0, "flower": 1.0, "bench": 1.0, "stack": 13.0, "stack/bench": 13.0}


def test_redis_is_also_counted_by_its_main_thread_which_sets_what_one_redis_core_carries(redis_server):
    from bench.meters.floor import against_floor
    from bench.stack.cpu import CpuSample, ms_per_image, sample

    assert list(sample(redis_server.port).redis_main) == [redis_server.process.pid]  # read from /proc

    before = CpuSample({7: ("redis", 1.0)}, redis_main={7: 0.8})
    after = CpuSample({7: ("redis", 1.3)}, redis_main={7: 0.85})  # io-threads did the rest
    table = ms_per_image(before, after, 100)
    assert table == {"redis": 3.0, "stack": 3.0, "redis-main": 0.5}  # the process counts in the stack, once
    assert against_floor(table, 1.0)["images_s_per_redis_core"] == 2000


def test_the_decode_floor_letterboxes_like_the_cpu_stage_and_counts_cpu_per_image():
    from bench.meters.floor import decode_floor_ms, prepare
    from bench.stack.corpus import photo_like_jpeg
    from tasks.decoding.imaging import decode_image, letterbox

    jpeg = photo_like_jpeg(3, size=(640, 360))
    canvas = prepare(jpeg, 64)
    assert len(canvas) == 64 * 64 * 3
    boxed = letterbox(*decode_image(jpeg, 64, 10**8), 64)  # what the CPU workers push: the content only
    assert (boxed.placement.width, boxed.placement.height, boxed.placement.pad_top) == (64, 36, 14)
    rows = np.frombuffer(canvas, np.uint8).reshape(64, 64, 3)
    assert (rows[:14] == 114).all() and (rows[50:] == 114).all()  # the same pad, around the same content
    content = np.frombuffer(boxed.pixels, np.uint8).reshape(36, 64, 3).astype(int)
    assert np.abs(rows[14:50].astype(int) - content).mean() < 8
    assert 0 < decode_floor_ms([jpeg, jpeg], 64, passes=1) < 1000
    with pytest.raises(ValueError):
        decode_floor_ms([], 64)


def test_the_stack_against_the_floor_and_the_capacity_it_implies():
    from bench.meters.floor import against_floor, describe

    figures = against_floor({"api": 2.0, "cpu-worker": 9.0, "redis": 0.5, "stack": 12.0}, 8.0)
    assert figures == {
        "decode_floor_ms": 8.0,
        "stack_over_floor": 1.5,
        "cores_per_1000_images_s": 12.0,
        "images_s_per_redis_core": 2000,
    }
    assert "1.50x" in describe(figures) and "2,000 images/s" in describe(figures)
    assert against_floor({}, 8.0) == {"decode_floor_ms": 8.0}  # no CPU figures: the floor alone


def test_stack_options_lay_extra_sections_over_their_own_and_set_the_sim_profile():
    from bench.stack.local import StackOptions

    options = StackOptions(
        sim_profile_ms={1: 2.0, 8: 6.0}, extra={"gpu_worker": {"max_attempts": 5}, "jobs": {"ttl_s": 60}}
    )
    config = options.config("redis://127.0.0.1:1/0")
    assert config["gpu_worker"] == {"device": "sim", "sim_latency_ms": {1: 2.0, 8: 6.0}, "max_attempts": 5}
    assert config["jobs"] == {"ttl_s": 60} and config["batching"]["max_batch_size"] == 8
    assert "sim_ms=1:2,8:6" in options.describe()


def test_an_ab_sides_own_settings_are_read_as_yaml_by_section_and_a_malformed_one_is_refused():
    from bench.load.ab import _laid_over, setting_overlay

    overlay = setting_overlay(["cache.enabled=false", "batching.window_ms=8", "cache.max_bytes=1024"])
    assert overlay == {"cache": {"enabled": False, "max_bytes": 1024}, "batching": {"window_ms": 8}}
    base = {"batching": {"max_batch_size": 8}, "celery": {"events_flush_ms": 50}}
    assert _laid_over(base, overlay) == {
        "batching": {"max_batch_size": 8, "window_ms": 8},
        "celery": base["celery"],
        "cache": overlay["cache"],
    }
    for malformed in ("cache.enabled", "enabled=false", ".enabled=false", "cache.=1"):
        with pytest.raises(ValueError):
            setting_overlay([malformed])


def test_each_bulk_shards_redis_is_a_role_of_its_own_and_part_of_the_stack(tmp_path):
    from bench.stack.cpu import CpuSample, ms_per_image, sample
    from bench.stack.processes import RedisServer

    shard = RedisServer(tmp_path)
    try:
        roles = sample(shard_ports=(shard.port,)).seconds
        assert roles[shard.process.pid][0] == "redis-shard0"  # found by its port, not counted as the Redis
    finally:
        shard.stop()
    before = CpuSample({1: ("api", 1.0), 2: ("redis-shard0", 0.0), 3: ("redis-shard1", 0.0)})
    after = CpuSample({1: ("api", 1.3), 2: ("redis-shard0", 0.05), 3: ("redis-shard1", 0.04)})
    table = ms_per_image(before, after, 100)
    assert table == {"api": 3.0, "redis-shard0": 0.5, "redis-shard1": 0.4, "stack": 3.9}


def test_instruction_counts_are_read_from_callgrind_and_differenced_per_unit():
    """Two runs of different lengths: what both share (start-up, imports) cancels out."""
    from bench.meters.instructions import Counted, callgrind_total, markdown, per_unit

    header = "# callgrind format\nversion: 1\ncmd: python\nevents: Ir\nsummary: 5000000\n\nfn=main\n1 10\n"
    assert callgrind_total(header) == 5_000_000
    assert callgrind_total("events: Ir\nfn=x\n1 1\ntotals: 77\n") == 77
    with pytest.raises(ValueError):
        callgrind_total("fn=main\n")
    assert per_unit(3_000_000, 11_000_000, 20, 100) == 100_000
    with pytest.raises(ValueError):
        per_unit(1, 2, 10, 10)
    task = Counted("cpu-task", "task", 102.5e6, reference=99.0e6)
    assert task.over_reference == pytest.approx(3.5e6)
    assert Counted("api", "submit + long-poll", 9.6e6).over_reference is None
    table = markdown({"this checkout": [task]})
    assert "| this checkout | cpu-task | task | 102.50 M | 99.00 M | 3.50 M | - |" in table


def test_a_marked_api_count_takes_the_workers_idle_rate_out_over_the_pairs_time():
    """bench instructions --marked / --cells: the per-second work (listener ticks) is not a request's."""
    from bench.meters.instructions import Counted, markdown
    from bench.meters.instructions_api import busy_less_idle

    # 100 pairs counted at 1,100 M over 25 s, the worker idle at 4 M a second: 1,000 M of pairs, 10 M each
    assert busy_less_idle(1_100_000_000, 25.0, 4_000_000.0, 100) == pytest.approx(10_000_000)
    with pytest.raises(ValueError):
        busy_less_idle(1, 1.0, 0.0, 0)
    row = Counted("api", "submit + poll, 2 cells (marked)", 9.8e6, idle_per_s=4.2e6)
    table = markdown({"2 cells": [row]})
    assert "| 2 cells | api | submit + poll, 2 cells (marked) | 9.80 M | - | - | 4.20 M |" in table


def test_bench_hostiles_files_pass_the_default_upload_limit_and_its_report_tallies_each_attack():
    """Each attack must reach a CPU worker (a file over api.max_upload_bytes is a 413 and measures nothing);
    the report names each attack's outcomes and the tenant's waits by phase."""
    from bench.hostile.images import ATTACKS, Sent, _tally
    from bench.hostile.images import markdown as hostile_markdown
    from contract.settings import ApiSettings

    sizes = {attack.name: len(attack.build()) for attack in ATTACKS}
    assert all(size <= ApiSettings().max_upload_bytes for size in sizes.values()), sizes
    sent = [
        Sent("GIF", "a" * 32, 0.0, "failed", "image_too_complex", 0.2),
        Sent("GIF", "b" * 32, 0.0, "failed", "image_too_complex", 0.4),
        Sent("PNG", None, 0.0, "refused", "http_413"),
    ]
    rows = _tally(sent, {"GIF": 10, "PNG": 20})
    assert rows[0] == {
        "attack": "GIF",
        "bytes": 10,
        "jobs": 2,
        "outcomes": {"failed image_too_complex": 2},
        "ended_after_s_max": 0.4,
    }
    assert rows[1]["outcomes"] == {"refused http_413": 1} and rows[1]["ended_after_s_max"] is None
    text = hostile_markdown(
        "side",
        {
            "options": "o",
            "qps": 4.0,
            "copies": 3,
            "attacks": rows,
            "tenant": {"quiet": {"jobs": 5, "succeeded": 5, "queue_cpu_ms": {"p50": 3.0, "p95": 9.0, "max": 12.0}}},
            "memory": {"quiet_peak_mb": 66.0, "attack_peak_mb": 107.0, "children_seen": 3, "children_at_start": 3},
        },
    )
    assert "| GIF | 10 | 2 | failed image_too_complex x2 | 0.40 s |" in text
    assert "| quiet | 5 | 0 | 5 | 3 ms | 9 ms | 12 ms |" in text and "0 replaced" in text  # jobs, refused, succeeded
