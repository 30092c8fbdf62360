"""One measured run of the bench, and whether it met the SLA: shared by the
commands of `python -m bench` and by `tune`."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

from bench.load import client
from bench.load.report import summarise
from bench.meters.floor import against_floor, decode_floor_ms
from bench.meters.redis_counts import per_image, read_counts
from bench.stack import cpu
from bench.stack.cpu import CpuScope
from contract.jobs.timebill import percentile


def measure(
    name: str,
    url: str,
    images: list[bytes],
    mode: str,
    level: float,
    duration_s: float,
    seed: int = 0,
    scope: CpuScope | None = CpuScope(),
    model: str | None = None,
    upload: str = "raw",
    repeat_share: float = 0.0,
    one_call: bool = False,
) -> dict[str, Any]:
    """One run: closed loop at `level` clients, or open loop at `level` QPS (to `model` when given); with
    the CPU each role of the deployment spent per image, when its processes are on this machine, and that
    against the decode floor measured right after the run on the same images (bench.meters.floor). Each request's
    image is new, or with probability `repeat_share` one sent before (client.ImageStream)."""
    label = f"{name} {mode} {'c=' if mode == 'closed' else ''}{level:g}{'' if mode == 'closed' else ' qps'}"
    label += f" model={model}" if model else ""
    label += " multipart" if upload == "multipart" else ""
    label += " one call" if one_call else ""
    label += f" repeats={repeat_share:.0%}" if repeat_share else ""
    stream = client.ImageStream(images, repeat_share, seed)
    with tqdm(desc=label, unit="req", leave=False, disable=not sys.stderr.isatty()) as progress:
        before = client.gpu_counters(url)
        cpu_before = scope.sample() if scope else None
        redis_before = read_counts(scope.redis_port) if scope else None
        machine_before = cpu.cpu_times()
        if mode == "closed":
            outcomes = client.closed_loop(
                url, stream, int(level), duration_s, tick=progress.update, model=model, upload=upload, one_call=one_call
            )
        else:
            outcomes = client.open_loop(
                url,
                stream,
                level,
                duration_s,
                seed=seed,
                tick=progress.update,
                model=model,
                upload=upload,
                one_call=one_call,
            )
        cpu_after = scope.sample() if scope else None
        redis_after = read_counts(scope.redis_port) if scope else None
        machine = cpu.cpu_shares(machine_before, cpu.cpu_times())
        after = client.gpu_counters(url)
    # Offered: what the Poisson draw actually sent (its count varies by a few % around the target).
    offered = len(outcomes) / duration_s if mode == "open" else None
    result = summarise(name, mode, outcomes, offered, int(level) if mode == "closed" else None, before, after)
    if cpu_before is not None and cpu_after is not None:
        result["cpu_ms_per_image"] = cpu.ms_per_image(cpu_before, cpu_after, result["succeeded"])
        result["floor"] = against_floor(
            result["cpu_ms_per_image"], decode_floor_ms(images, client.input_size(url, model))
        )
    if (counts := per_image(redis_before, redis_after, result["succeeded"])) is not None:
        result["redis_per_image"] = counts
    result["machine_cpu"] = machine  # busy and stolen shares of this machine's cores over the run
    if mode == "open":
        result["target_qps"] = level
    if model:
        result["model"] = model
    result["upload"] = upload
    result["calls"] = "one" if one_call else "two"
    result["repeat_share"] = repeat_share
    hits = [o for o in outcomes if o.ok and (o.doc or {}).get("cache") == "hit"]
    result["cache_hits"] = len(hits)
    if hits:  # a hit's 202 carries its answer: the whole request, as the client saw it
        answers = sorted(o.latency_s * 1000.0 for o in hits)
        result["cache_hit_ms"] = {"p50": round(percentile(answers, 50), 2), "p95": round(percentile(answers, 95), 2)}
        # After the run, on the idle stack: a hit's first poll, the API's answer for a job stored over already.
        seen, at_api = client.first_polls(url, [str(o.doc["id"]) for o in hits if o.doc and "id" in o.doc])
        for key, taken in (("cache_hit_poll_ms", sorted(seen)), ("cache_hit_poll_api_ms", sorted(at_api))):
            if taken:
                result[key] = {
                    "p50": round(percentile(taken, 50), 2),
                    "p95": round(percentile(taken, 95), 2),
                    "polls": len(taken),
                }
    ratio = result.get("floor", {}).get("stack_over_floor")
    print(
        f"  {label}: {result['achieved_qps']:.2f} QPS, p95 {result['latency_ms']['p95']} ms, "
        f"failed {sum(result['failures'].values())}" + (f", CPU {ratio:.2f}x the decode floor" if ratio else ""),
        file=sys.stderr,
    )
    return result


def hit_cost(without_repeats: dict, with_repeats: dict) -> dict[str, float] | None:
    """What one result-cache hit costs the whole stack, from two runs at the same load, one without repeats
    (every image a miss: m ms per image) and one with (a share h of hits, c ms per image): c = (1-h)m + h*hit."""
    miss = (without_repeats.get("cpu_ms_per_image") or {}).get("stack")
    mixed = (with_repeats.get("cpu_ms_per_image") or {}).get("stack")
    share = with_repeats["cache_hits"] / with_repeats["succeeded"] if with_repeats.get("succeeded") else 0.0
    if not miss or not mixed or share <= 0:
        return None
    hit = max(0.0, (mixed - (1.0 - share) * miss) / share)
    return {
        "hit_share": round(share, 4),
        "miss_ms": round(miss, 3),
        "hit_ms": round(hit, 3),
        "hit_over_miss": round(hit / miss, 4),
    }


def meets_sla(result: dict, sla_ms: float) -> bool:
    """Within the SLA, nothing failed, and the service kept up with what was offered."""
    p95 = result["latency_ms"]["p95"]
    offered = result.get("offered_qps")
    enough = offered is None or result["achieved_qps"] >= 0.97 * offered
    return p95 is not None and p95 <= sla_ms and not result["failures"] and enough
