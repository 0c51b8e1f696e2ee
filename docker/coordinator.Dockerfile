# syntax=docker/dockerfile:1
# deltarl coordinator: versions, workers, trajectory queue, status page (port 8700).
# Light image: the core dependencies plus the `redis` extra; no torch, numpy or numba.
# Build from the repository root:  docker build -f docker/coordinator.Dockerfile -t deltarl-coordinator .

FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# deltarl/<folder> are symlinks to the top-level folders: copy both, the wheel packages them.
COPY pyproject.toml README.md ./
COPY deltarl/ deltarl/
COPY services/ services/
COPY env_server/ env_server/
COPY trainer/ trainer/
COPY rollout/ rollout/
RUN pip wheel --no-deps . -w /wheels \
    && pip install "$(ls /wheels/deltarl-*.whl)[redis]"

FROM python:3.11-slim
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin deltarl \
    && mkdir -p /data && chown 1000:1000 /data
COPY --from=builder /opt/venv /opt/venv
COPY docker/healthcheck.py /opt/deltarl/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DELTARL_COORDINATOR_SQLITE_PATH=/data/coordinator.sqlite3
USER 1000
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8700
HEALTHCHECK --interval=10s --timeout=5s --start-period=15s --retries=3 \
    CMD ["python", "/opt/deltarl/healthcheck.py", "http://127.0.0.1:8700/health", "--tls-env", "DELTARL_COORDINATOR_TLS_CERTFILE"]
ENTRYPOINT ["deltarl", "coordinator"]
CMD ["--host", "0.0.0.0", "--port", "8700"]
