# hetnode daemon image for the compose swarm (docker-compose.yml, docs/operations.md). CPU only.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# iproute2: `tc`, which the edge containers use to shape their own uplink (configs/docker/edge-entrypoint.sh)
RUN apt-get update \
    && apt-get install -y --no-install-recommends iproute2 \
    && rm -rf /var/lib/apt/lists/*

# torch first, pinned to the CPU wheel (same pin as the Makefile): an open range would pull a CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
COPY pyproject.toml README.md ./
COPY hetnode ./hetnode
COPY bootstrap ./bootstrap
RUN pip install .

# run configs (`--config configs/tiny.toml` is relative to /app) and the edge entrypoint
COPY configs ./configs

ENTRYPOINT ["hetnode"]
CMD ["--help"]
