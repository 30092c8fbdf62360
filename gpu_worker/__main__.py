"""python -m gpu_worker [--config FILE] [--device cuda:0|cpu|sim] [--model NAME[:VERSION]]... [--worker-id ID]
[--metrics-port 9100]"""

from __future__ import annotations

import argparse
import logging
import sys

import redis
import torch

from contract.library import check_library_at_start
from contract.redis.clock import CLOCK
from contract.redis.connection import connect
from contract.runtime.logs import configure_logging
from contract.runtime.memory import keep_freed_memory
from contract.settings.config import load_settings
from contract.settings.models import Catalogue
from contract.settings.sections import SettingsError
from gpu_worker import metrics
from gpu_worker.devices import open_device
from gpu_worker.heartbeat import WorkerIdInUse
from gpu_worker.model import ModelLoadError
from gpu_worker.worker import GpuWorker, default_worker_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_worker", description=__doc__)
    parser.add_argument("--config", help="YAML laid over configs/default.yaml (default: $IMGSERVE_CONFIG)")
    parser.add_argument("--device", help="auto | cpu | cuda | cuda:N | sim (default: from config)")
    parser.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME[:VERSION]",
        help="serve this model (each version of NAME, or one); repeat for several; "
        "default: gpu_worker.models, else every model configured",
    )
    parser.add_argument("--worker-id", help="stable id; default host-device")
    parser.add_argument(
        "--metrics-port", type=int, help="serve Prometheus metrics here (default: gpu_worker.metrics_port; 0: none)"
    )
    parser.add_argument("--metrics-host", help="the address the metrics port binds (default: gpu_worker.metrics_host)")
    args = parser.parse_args(argv)
    keep_freed_memory()
    configure_logging("gpu-worker")
    settings = load_settings(args.config)
    configure_logging("gpu-worker", settings.logs)
    if settings.gpu_worker.torch_threads:
        torch.set_num_threads(settings.gpu_worker.torch_threads)
    try:
        specs = Catalogue(settings).select(args.model or settings.gpu_worker.models)
    except SettingsError as exc:
        logging.getLogger("gpu_worker").error("%s", exc)
        return 2
    devices = []
    for spec in specs:
        try:
            devices.append(
                open_device(
                    spec,
                    args.device or settings.gpu_worker.device,
                    settings.batching.max_batch_size,
                    settings.gpu_worker.max_candidates,
                    settings.gpu_worker.sim_latency_ms,
                )
            )
        except ModelLoadError as exc:
            logging.getLogger("gpu_worker").error("cannot serve the model %s: %s", spec.key, exc)
            return 2
    metrics.serve(
        settings.gpu_worker.metrics_port if args.metrics_port is None else args.metrics_port,
        args.metrics_host or settings.gpu_worker.metrics_host,
    )
    client = connect(settings, socket_timeout=30.0)
    check_library_at_start(client, logging.getLogger("gpu_worker"))
    CLOCK.follow(client)  # the stamps, deadlines and heartbeat scores it writes: the service's clock
    worker = GpuWorker(settings, client, devices, args.worker_id or default_worker_id(devices[0]))
    try:
        return worker.run()
    except WorkerIdInUse as exc:
        logging.getLogger("gpu_worker").error("refusing to start: %s", exc)
        return 2
    except redis.RedisError:  # told to stop while Redis was away (logged where it gave up)
        return 1


if __name__ == "__main__":
    sys.exit(main())
