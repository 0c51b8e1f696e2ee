# deltarl coordinator: versions, workers, trajectory queue, status page (port 8700).
# Light image: the core dependencies plus the `redis` extra; no torch, numpy or numba.
# Build from the repository root:  docker build -f docker/coordinator.Dockerfile -t deltarl-coordinator .
# Stages: `reqs` lists the requirements out of pyproject.toml (docker/requirements.py); `deps`
# installs them into a venv, a layer reused until that list changes (not on every edit of
# pyproject.toml: the list is copied by content); `wheel` builds deltarl from the source (the
# whole build context, which .dockerignore limits to the package); the runtime stage copies the
# venv and installs the wheel into it (every requirement already satisfied).

FROM python:3.11-slim AS reqs
COPY pyproject.toml docker/requirements.py /deps/
RUN python /deps/requirements.py /deps/pyproject.toml redis > /deps/requirements.txt

FROM python:3.11-slim AS deps
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=reqs /deps/requirements.txt /deps/requirements.txt
RUN pip install -r /deps/requirements.txt

FROM deps AS wheel
COPY . /src
RUN pip wheel --no-deps /src -w /wheels

FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin deltarl \
    && mkdir -p /data && chown 1000:1000 /data
COPY --from=deps /opt/venv /opt/venv
COPY --from=wheel /wheels /tmp/wheels
RUN /opt/venv/bin/pip install "$(ls /tmp/wheels/deltarl-*.whl)[redis]" && rm -rf /tmp/wheels
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
