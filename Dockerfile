# softmoe-serve images. Two targets:
#
#   docker build --target gpu -t softmoe-serve:0.1.0-gpu .   # CUDA, torch + onnxruntime-gpu + TensorRT
#   docker build --target cpu -t softmoe-serve:0.1.0-cpu .   # python:3.11-slim, CPU torch + onnxruntime
#
# Both run as uid/gid 10001 and work with a read-only root filesystem: the only writable paths are
# the /tmp and /cache volumes (SOFTMOE_CACHE_DIR=/cache holds exported ONNX files and TensorRT
# engines). TensorRT engines are never built here: they are specific to the GPU model, driver and
# TensorRT version, so `softmoe serve --backend tensorrt` builds them at start-up on the GPU it runs
# on, into /cache/engines, keyed by (weights, graph, TensorRT version, GPU, compute capability,
# precision, batch profile).
#
# Models: mount model packages under /models and list them, e.g.
#   docker run --gpus 1 -v $PWD/pkgs:/models:ro -e SOFTMOE_MODELS='["vit=/models/vit"]' ...
# With no SOFTMOE_MODELS (or --model) the built-in default models (digits, digits-lit) are served.
#
# Versions are pinned here (base images by tag, Python packages by version); bump them together.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

# ---------------------------------------------------------------------------------------------------
# GPU: shared base (CUDA runtime + cuDNN from the base image, Python 3.12 from Ubuntu 24.04).
FROM ${CUDA_IMAGE} AS gpu-base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu's archive drops superseded package versions, so exact apt pins break rebuilds; the base
# image tag is pinned instead and every Python package below is pinned by version.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 softmoe \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin softmoe

FROM gpu-base AS gpu-build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3-venv \
    && rm -rf /var/lib/apt/lists/*
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu128
ARG ONNXRUNTIME_VERSION=1.31.1
# The server is written to the TensorRT 10 API: stay on 10.x until TensorRT 11 is tested.
ARG TENSORRT_VERSION=10.16.1.11
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
        "torch==${TORCH_VERSION}+${TORCH_CUDA}"
COPY pyproject.toml README.md constraints.txt /src/
COPY softmoe_models /src/softmoe_models
COPY export /src/export
COPY server /src/server
# constraints.txt pins torch==X (the +cuXXX build installed above satisfies it) and the input parsers.
RUN pip install --no-cache-dir --extra-index-url https://pypi.nvidia.com -c /src/constraints.txt \
        "onnxruntime-gpu==${ONNXRUNTIME_VERSION}" "tensorrt==${TENSORRT_VERSION}" "/src[gpu,tensorrt]" \
    && pip check

FROM gpu-base AS gpu
COPY --from=gpu-build /opt/venv /opt/venv
RUN mkdir -p /cache /models && chown 10001:10001 /cache
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SOFTMOE_CACHE_DIR=/cache \
    SOFTMOE_BACKEND=tensorrt \
    SOFTMOE_DEVICE=cuda \
    SOFTMOE_PRECISION=fp16 \
    SOFTMOE_PORT=8000 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
VOLUME ["/tmp", "/cache"]
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
# Kubernetes ignores HEALTHCHECK (its probes are the contract); this serves `docker run`/compose.
# Start-up includes the TensorRT engine build on a cold cache, hence the long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/live' % os.environ.get('SOFTMOE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["softmoe"]
CMD ["serve", "--host", "0.0.0.0"]

# ---------------------------------------------------------------------------------------------------
# CPU: python:3.11-slim, CPU torch wheel, onnxruntime.
FROM ${PYTHON_IMAGE} AS cpu-build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ARG TORCH_VERSION=2.13.0
ARG ONNXRUNTIME_VERSION=1.31.1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}+cpu"
COPY pyproject.toml README.md constraints.txt /src/
COPY softmoe_models /src/softmoe_models
COPY export /src/export
COPY server /src/server
RUN pip install --no-cache-dir -c /src/constraints.txt "onnxruntime==${ONNXRUNTIME_VERSION}" "/src[cpu]" \
    && pip check

FROM ${PYTHON_IMAGE} AS cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN groupadd --gid 10001 softmoe \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin softmoe \
    && mkdir -p /cache /models \
    && chown 10001:10001 /cache
COPY --from=cpu-build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SOFTMOE_CACHE_DIR=/cache \
    SOFTMOE_BACKEND=torch \
    SOFTMOE_DEVICE=cpu \
    SOFTMOE_PORT=8000
VOLUME ["/tmp", "/cache"]
USER 10001:10001
WORKDIR /tmp
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/live' % os.environ.get('SOFTMOE_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["softmoe"]
CMD ["serve", "--host", "0.0.0.0"]
