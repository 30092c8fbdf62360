# One image per role. `app` runs the API, the CPU workers and Flower (no torch
# in it: a CPU worker that imports torch pays seconds and hundreds of MB per
# child); `gpu-worker` adds PyTorch (PyPI's Linux wheel is the CUDA build).
# BASE_IMAGE: any Debian-like image with Python 3.11 and pip (scripts/compose-images makes a local stand-in
# where registries are out of reach). The GPU worker's torch is PyPI's CUDA build unless GPU_BASE_IMAGE is
# an image that already holds torch (scripts/compose-images --torch-cpu: a CPU build, for a host without a
# GPU) or TORCH_INDEX_URL names another wheel index (a CPU-only one, a local mirror).
# Dependencies are installed before the code is copied, so a change of code rebuilds in seconds.
ARG BASE_IMAGE=python:3.11-slim
ARG GPU_BASE_IMAGE=

FROM ${BASE_IMAGE} AS app
WORKDIR /srv/imgserve
# The service runs from here (its pyproject installs dependencies only, no packages).
ENV PYTHONUNBUFFERED=1 PROMETHEUS_MULTIPROC_DIR=/tmp/prometheus PYTHONPATH=/srv/imgserve
# The API runs as nobody and writes its multiprocess metrics here.
RUN mkdir -p /tmp/prometheus && chmod 1777 /tmp/prometheus
COPY pyproject.toml README.md ./
# Pillow-SIMD is built from source here: the CPU workers decode with it. The GPU worker never imports
# Pillow, so its image has neither the compiler nor the library.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential libjpeg62-turbo-dev zlib1g-dev libwebp-dev \
 && rm -rf /var/lib/apt/lists/* \
 && pip install --no-cache-dir ".[run]" \
 # Pillow-SIMD last, from source, so nothing replaces it.
 && pip install --no-cache-dir --no-deps --force-reinstall --no-binary pillow-simd "pillow-simd==12.1.1.post0" \
 && python -c "import PIL, re; assert re.search(r'\.post\d+$', PIL.__version__), PIL.__version__"
COPY contract ./contract
COPY app ./app
COPY tasks ./tasks
COPY configs ./configs
USER nobody
# A container is reached through its network: the API binds every address here (the settings' default is
# 127.0.0.1, make run's on a laptop).
ENV IMGSERVE_API__BIND=0.0.0.0:8000
EXPOSE 8000 5555

FROM ${GPU_BASE_IMAGE:-${BASE_IMAGE}} AS gpu-worker
WORKDIR /srv/imgserve
ENV PYTHONUNBUFFERED=1 PYTHONPATH=/srv/imgserve
COPY pyproject.toml README.md ./
ARG TORCH_INDEX_URL=
# torch already in GPU_BASE_IMAGE satisfies torch==2.13.0 (a +cpu build too): pip then installs no other.
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==2.13.0"; fi \
 && pip install --no-cache-dir ".[gpu]"
COPY contract ./contract
COPY gpu_worker ./gpu_worker
COPY configs ./configs
# The default model's weights (configs/models/shapes-yolo.yaml points here).
COPY models ./models
EXPOSE 9100
CMD ["python", "-m", "gpu_worker", "--metrics-port", "9100"]
