"""The serial baseline server:

    .venv/bin/python -m baseline --port 8100 [--device sim|cpu|cuda] [--config FILE]

HTTP parse -> decode -> letterbox -> normalise -> infer -> post-process ->
serialise, in the request thread, with one thread. `POST /v1/jobs` answers
200 with the finished job document (the same JSON as the pipeline's
`GET /v1/jobs/<id>`), so the bench can drive both alike.
"""

from __future__ import annotations

import argparse
import logging
import time
import uuid

from flask import Flask, Response, g, jsonify, request

from app.problems import Problem, problem_response
from app.uploads import check_image, parse_options
from baseline.inference import BatchRunner
from contract.frames import Frame, FrameHeader
from contract.settings import Settings
from contract.settings.config import load_settings
from gpu_worker.devices import open_device
from gpu_worker.staging import Device
from tasks.decoding.imaging import ImageDecodeError, decode_image, letterbox


def create_baseline_app(settings: Settings, device: Device) -> Flask:
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.api.max_upload_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]  # Flask's DefaultJSONProvider has it
    runner = BatchRunner(device)
    app.register_error_handler(Problem, problem_response)

    @app.before_request
    def stamp_arrival() -> None:
        g.received_at = time.time()

    @app.post("/v1/jobs")
    def detect() -> Response:
        data = (
            request.get_data(cache=False)
            if request.mimetype != "multipart/form-data"
            else request.files["image"].read()
        )
        check_image(data, None)
        options = parse_options({**request.args, **request.form}, settings.jobs.default_deadline_ms)
        parsed_at = time.time()
        spec = device.spec
        try:
            t0 = time.perf_counter()
            image, orig = decode_image(
                data, spec.input_size, settings.decode.max_image_pixels, settings.decode.max_decoded_bytes
            )
            t1 = time.perf_counter()
            boxed = letterbox(image, orig, spec.input_size)
            t2 = time.perf_counter()
        except ImageDecodeError as exc:
            return jsonify(
                {"id": uuid.uuid4().hex, "status": "failed", "error": {"code": exc.code, "message": str(exc)}}
            )
        header = FrameHeader(
            job_id="baseline",
            **boxed.placement.fields(),
            deadline_at=0.0,
            options=dict(options.for_model()),
        )
        run = runner.run([Frame(header=header, pixels=memoryview(boxed.pixels))])
        if run.errors:
            return jsonify({"id": uuid.uuid4().hex, "status": "failed", "error": run.errors[0]})
        timings = {
            "receive": (parsed_at - g.received_at) * 1000,
            "decode": (t1 - t0) * 1000,
            "resize": (t2 - t1) * 1000,
            "infer": run.infer_ms,
            "postprocess": run.postprocess_ms,
            "total": (time.time() - g.received_at) * 1000,
        }
        return jsonify(
            {
                "id": uuid.uuid4().hex,
                "status": "succeeded",
                "result": run.documents[0],
                "timings_ms": {k: round(v, 3) for k, v in timings.items()},
                "batch": {"size": 1, "id": "serial"},
            }
        )

    @app.get("/v1/stats")
    def stats() -> Response:
        return jsonify(
            {
                "mode": "baseline",
                "gpu": {
                    "busy": runner.busy.fraction(),
                    "device_seconds_total": runner.busy.total_s,
                    "simulated": device.simulated,
                },
            }
        )

    @app.get("/healthz")
    def healthz() -> Response:
        return jsonify({"status": "ok", "mode": "baseline"})

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config")
    parser.add_argument("--device", default=None, help="auto | cpu | cuda | sim (default: from config)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    settings = load_settings(args.config)
    device = open_device(
        settings.model,
        args.device or settings.gpu_worker.device,
        1,
        settings.gpu_worker.max_candidates,
        settings.gpu_worker.sim_latency_ms,
    )
    app = create_baseline_app(settings, device)
    from werkzeug.serving import run_simple

    # threaded=False, processes=1: exactly one request at a time, as in the story.
    run_simple(args.host, args.port, app, threaded=False, processes=1)


if __name__ == "__main__":
    main()
