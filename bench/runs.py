"""One measured run of the bench, and whether it met the SLA: shared by the
commands of `python -m bench` and by `tune`."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from bench import cpu, load
from bench.floor import against_floor, decode_floor_ms
from bench.report import summarise


@dataclass(frozen=True)
class CpuScope:
    """Which processes of this machine are the deployment: a Redis port, and (a bench stack's) the
    process sessions of its roles; None: every local process of a role."""
    redis_port: int | None = 6379
    sessions: frozenset[int] | None = None

    def sample(self) -> cpu.CpuSample:
        return cpu.sample(self.redis_port, os.getpid(), set(self.sessions) if self.sessions is not None else None)


def measure(name: str, url: str, images: list[bytes], mode: str, level: float, duration_s: float,
            seed: int = 0, scope: CpuScope | None = CpuScope(), model: str | None = None,
            upload: str = "raw") -> dict[str, Any]:
    """One run: closed loop at `level` clients, or open loop at `level` QPS (to `model` when given); with
    the CPU each role of the deployment spent per image, when its processes are on this machine, and that
    against the decode floor measured right after the run on the same images (bench.floor)."""
    label = f"{name} {mode} {'c=' if mode == 'closed' else ''}{level:g}{'' if mode == 'closed' else ' qps'}"
    label += f" model={model}" if model else ""
    label += " multipart" if upload == "multipart" else ""
    with tqdm(desc=label, unit="req", leave=False, disable=not sys.stderr.isatty()) as progress:
        before = load.gpu_counters(url)
        cpu_before = scope.sample() if scope else None
        machine_before = cpu.cpu_times()
        if mode == "closed":
            outcomes = load.closed_loop(url, images, int(level), duration_s, tick=progress.update, model=model,
                                        upload=upload)
        else:
            outcomes = load.open_loop(url, images, level, duration_s, seed=seed, tick=progress.update, model=model,
                                      upload=upload)
        cpu_after = scope.sample() if scope else None
        machine = cpu.cpu_shares(machine_before, cpu.cpu_times())
        after = load.gpu_counters(url)
    # Offered: what the Poisson draw actually sent (its count varies by a few % around the target).
    offered = len(outcomes) / duration_s if mode == "open" else None
    result = summarise(name, mode, outcomes, offered, int(level) if mode == "closed" else None, before, after)
    if cpu_before is not None and cpu_after is not None:
        result["cpu_ms_per_image"] = cpu.ms_per_image(cpu_before, cpu_after, result["succeeded"])
        result["floor"] = against_floor(result["cpu_ms_per_image"],
                                        decode_floor_ms(images, load.input_size(url, model)))
    result["machine_cpu"] = machine   # busy and stolen shares of this machine's cores over the run
    if mode == "open":
        result["target_qps"] = level
    if model:
        result["model"] = model
    result["upload"] = upload
    ratio = result.get("floor", {}).get("stack_over_floor")
    print(f"  {label}: {result['achieved_qps']:.2f} QPS, p95 {result['latency_ms']['p95']} ms, "
          f"failed {sum(result['failures'].values())}" + (f", CPU {ratio:.2f}x the decode floor" if ratio else ""),
          file=sys.stderr)
    return result


def meets_sla(result: dict, sla_ms: float) -> bool:
    """Within the SLA, nothing failed, and the service kept up with what was offered."""
    p95 = result["latency_ms"]["p95"]
    offered = result.get("offered_qps")
    enough = offered is None or result["achieved_qps"] >= 0.97 * offered
    return p95 is not None and p95 <= sla_ms and not result["failures"] and enough
