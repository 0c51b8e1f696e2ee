# deltarl trainer (GPU): GRPO on the coordinator's trajectories, publishes every step to the bucket.
# Base: PyTorch's CUDA runtime image (torch + CUDA + cuDNN); deltarl and the `model` and `s3`
# extras are installed on top, keeping the base image's torch (it must satisfy pyproject's range).
# Build from the repository root:  docker build -f docker/trainer.Dockerfile -t deltarl-trainer .
# Another PyTorch/CUDA version:     --build-arg TORCH_IMAGE=pytorch/pytorch:<tag>
# The trainer serves no HTTP: no port. Its health check asks whether the coordinator answers.

ARG TORCH_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# the whole build context, which .dockerignore limits to the package (docker/README.md)
COPY . /src
RUN pip wheel --no-deps /src -w /wheels

FROM ${TORCH_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=builder /wheels /tmp/wheels
# Pin the base image's torch build (e.g. 2.8.0+cu128) so that pip never swaps it for another.
RUN echo "torch==$(python -c 'import torch; print(torch.__version__)')" > /tmp/torch.txt \
    && pip install -c /tmp/torch.txt "$(ls /tmp/wheels/deltarl-*.whl)[model,s3]" \
    && rm -rf /tmp/wheels /tmp/torch.txt
# UID 1000 (Hugging Face Spaces' user; some bases already have one: keep it, use its UID).
RUN (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --create-home --shell /usr/sbin/nologin deltarl) \
    && mkdir -p /data /bucket && chown 1000:1000 /data /bucket
COPY docker/healthcheck.py /opt/deltarl/healthcheck.py
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/data \
    HF_HOME=/data/.cache/huggingface
USER 1000
# run directory (settings, metrics, checkpoints: runs/train) and the model cache
WORKDIR /data
VOLUME ["/data"]
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "/opt/deltarl/healthcheck.py", "--url-env", "DELTARL_TRAINER_COORDINATOR_URL"]
ENTRYPOINT ["deltarl", "train"]
CMD []
