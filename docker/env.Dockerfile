# syntax=docker/dockerfile:1
# deltarl env server: Wordle over OpenEnv's protocol (HTTP /reset /step /state, WS /ws; port 8001).
# Light image: the core dependencies only; no torch, numpy or numba.
# Build from the repository root:  docker build -f docker/env.Dockerfile -t deltarl-env .

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
    && pip install "$(ls /wheels/deltarl-*.whl)"

FROM python:3.11-slim
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin deltarl
COPY --from=builder /opt/venv /opt/venv
COPY docker/healthcheck.py /opt/deltarl/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 1000
WORKDIR /home/deltarl
EXPOSE 8001
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "/opt/deltarl/healthcheck.py", "http://127.0.0.1:8001/health", "--tls-env", "DELTARL_ENV_TLS_CERTFILE"]
ENTRYPOINT ["deltarl", "env"]
CMD ["--host", "0.0.0.0", "--port", "8001"]
