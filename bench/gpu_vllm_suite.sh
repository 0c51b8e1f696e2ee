#!/usr/bin/env bash
# The vLLM engine's GPU benchmarks and tests in one go (docs/vllm.md, docs/benchmarks.md): run
# from the repository root on a machine with CUDA GPUs where vLLM 0.33.0 and the project import.
#
#   bash bench/gpu_vllm_suite.sh RESULTS_DIR [STEP...]
#
# deltarl must be installed (`pip install -e '.[all]'`, or `pip install --no-deps --target DIR .`
# with DIR on PYTHONPATH): the top-level folders are deltarl.* only through the install.
# PYTHONSAFEPATH keeps the repository's own deltarl/ folder from shadowing a non-editable install.
#
# Steps (default: check tests speed system faults system_hf), each logging to
# RESULTS_DIR/<step>.log; RESULTS_DIR/status gets one line per finished step with its exit code.
# The benchmarks write their results to bench/results/ (named by benchmark, GPU and model; then
# `python bench/report.py --write` renders docs/benchmarks.md), and the test steps' outcomes go to
# bench/results/gpu_tests_<gpus>_vllm.json (bench/gpu_tests_result.py) when the suite ends; then
# every result file the run wrote is also copied to RESULTS_DIR/results/:
#   check    bench/vllm_check.py: bucket followed bit-identically, wire path, logprobs
#   tests    the vllm engine's tests, the gpu ones included (layouts, async stamps, end to end)
#   speed    bench/vllm_speed.py: engine vs vLLM with the engine's settings vs vLLM's defaults,
#            interleaved rounds of fresh processes (DELTARL_SPEED_ROUNDS, default 5; with
#            DELTARL_SPEED_BUDGET_S no round starts that would end later), batch 32 and 256 and
#            multi-turn episodes with and without prefix reuse; RESULTS_DIR/speed/ gets the JSON,
#            the tables (vllm_speed.md) and every process's log
#   speed_extra  the same for the engine without async scheduling and in-process vLLM defaults
#   prefix   the gpu test of prefix caching salted per weight state
#   system   the whole system, SmolLM2 on Wordle as a user would run it: bench/gpu_wordle_full.sh
#            on one GPU (the trainer and one vllm worker on GPU 0; DELTARL_SUITE_WORKER_GPUS),
#            the warm start (4,000 solver games, deltarl sft), then GRPO through the whole system
#            for DELTARL_SUITE_RUN_S seconds (default 300), the untrained, SFT and final policies
#            each played by deltarl eval (DELTARL_SUITE_EVAL_GAMES games, default 100); about
#            15 minutes; RESULTS_DIR/wordle-warm/ gets the pipeline's files, bench/results/ the run
#   system_cold  the same run from SmolLM2 as published (bench/wordle_gpu_run.py --engine
#            vllm, no warm start: it learns valid moves, not games a user would accept)
#   faults   the fault suite's worker kills with vllm workers
#   system_hf  the same whole-system run with the transformers engine
#   system_2gpu  one vllm worker per GPU (needs 2 GPUs)
#   system_fsdp  the whole system with an FSDP2 trainer of 2 ranks (GPUs 0-1) and one vllm
#                worker on each of GPUs 2 and 3 (needs 4 GPUs)
#   tp       bench/vllm_tp.py: one engine at tensor parallelism 2 following a bucket, vs 1 (2 GPUs)
#   teacher  bench/teacher_vllm_check.py: deltarl teacher with the vllm engine vs transformers,
#            in bfloat16 (within bf16 rounding of the logits) and in float32 (plain tolerance)
#   tests_tp the gpu tests of tensor parallelism, Engine.score on vLLM and the vLLM teacher
#   moe      mixture of experts: tests/rollout/test_vllm_moe_gpu.py (a tiny Qwen3-MoE followed
#            through real trainer steps at TP=1, and at TP=2 / expert parallelism 2 on 2 GPUs, in
#            bf16 and in block fp8)
#            and the CPU tests of the expert mapping
#   fp8      block-fp8 workers: tests/rollout/test_vllm_fp8_gpu.py with VLLM_USE_DEEP_GEMM=0 (vLLM
#            serves the checkpoint's e4m3 bytes and scales, a delta applied in one pause and
#            verified, the engine following a publish.fp8 bucket at TP=1 and on 2 GPUs TP=2)
#   fsdp_fp8_nccl  the FSDP2 fp8 publication test on 2 GPUs (NCCL ranks quantizing on their GPUs,
#            tests/trainer/test_fsdp_fp8.py): the same bytes as one CPU process
#   fsdp7b_fp8  bench/fsdp_publish_bench.py on 2 GPUs, the 7B configuration (Qwen2.5-7B's shapes,
#            random init, real AdamW steps): bf16 and 128 x 128 block-fp8 versions of the same steps
#   fp8_capitals  learning with fp8 workers: bench/gpu_capitals_ab.sh with AB=fp8 (the capitals
#            task, bf16 vs block-fp8 vllm workers, seeds DELTARL_SUITE_SEEDS, default "0 1")
#   moe_scale  bench/moe_scale.py: Qwen3-30B-A3B's layer shapes (DELTARL_MOE_LAYERS layers,
#            default 8; 48 is the whole model), publication by DELTARL_MOE_RANKS ranks (default
#            2; ranks take the GPUs round-robin) over DELTARL_MOE_STEPS steps (default 4) and the
#            apply into vLLM
#   moe_scale_fp8  moe_scale with --fp8: the ranks publish block fp8, vLLM serves the experts
#            in fp8 (its fused MoE's block-fp8 path) and takes every delta in one pause
#   system_moe  system_fsdp with the mixture of experts upcycled from SmolLM2 (--model-kind
#            smollm2-moe: 8 experts, top-2): FSDP2 trainer on GPUs 0-1, a vllm worker on each of
#            GPUs 2 and 3; its summary holds the trainer-vs-worker logprob gap (beside
#            system_fsdp's, the dense model's, for the same settings)
#   system_moe_r3  system_moe with routing replay (run.routing_replay: the workers return each
#            token's experts, the trainer routes through them); its gap beside system_moe's
#   system_moe_1gpu, system_moe_1gpu_r3  the same two on one GPU (the trainer and one vllm
#            worker on GPU 0, as system_cold, the dense model's run with the same settings):
#            the gap with and without routing replay where only one GPU is at hand
#   system_moe_1gpu_s0  system_moe_1gpu with run.max_staleness = 0: every trained trajectory
#            sampled by the version the trainer scores it with, so the gap holds no policy lag
set -uo pipefail
RES=${1:?results directory}
shift
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(check tests speed system faults system_hf)
mkdir -p "$RES"
touch "$RES/.started"  # the results written after this are copied to RES/results at the end
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
# ... which also keeps bench/ off sys.path: the scripts import bench/common.py as `common`
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
SECONDS_RUN=${DELTARL_SUITE_RUN_S:-300}
# the reward is wordle_gpu_run.py's default, shaped: every valid new guess scores, a repeated or
# invalid one earns nothing (the final reward's format credit taught a run to repeat one word)
WORDLE=(--max-guesses 6 --max-invalid 1 --max-new-tokens 24 --lr 1e-5 --duration "$SECONDS_RUN")

run() {
  local name=$1
  shift
  echo "=== $name: $*" >"$RES/$name.log"
  local t0=$SECONDS
  "$@" >>"$RES/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" >>"$RES/status"
}

for step in "${steps[@]}"; do
  case $step in
    check) run check python3 bench/vllm_check.py ;;
    tests) run tests timeout 420 python3 -m pytest -q -s -p no:cacheprovider -o faulthandler_timeout=150 \
      tests/rollout/test_apply_kernel_gpu.py tests/rollout/test_vllm_gpu.py tests/rollout/test_vllm_engine.py ;;
    speed) run speed python3 bench/vllm_speed.py --out-dir "$RES/speed" \
      --rounds "${DELTARL_SPEED_ROUNDS:-5}" ${DELTARL_SPEED_BUDGET_S:+--budget-s "$DELTARL_SPEED_BUDGET_S"} ;;
    speed_extra) run speed_extra python3 bench/vllm_speed.py --out-dir "$RES/speed_extra" \
      --columns engine_sync llm_inproc --rounds "${DELTARL_SPEED_ROUNDS:-5}" \
      ${DELTARL_SPEED_BUDGET_S:+--budget-s "$DELTARL_SPEED_BUDGET_S"} ;;
    prefix) run prefix timeout 300 python3 -m pytest -q -s -p no:cacheprovider -o faulthandler_timeout=150 \
      tests/rollout/test_vllm_gpu.py -k prefix_cache ;;
    system) run system env WORKER_GPUS="${DELTARL_SUITE_WORKER_GPUS:-0}" GPU_MEM_UTIL=0.25 \
      EVAL_GPU_UNTRAINED="" EVAL_GAMES="${DELTARL_SUITE_EVAL_GAMES:-100}" DURATION="$SECONDS_RUN" \
      RESULT=1 WORK_DIR="$RES/wordle-work" bash bench/gpu_wordle_full.sh "$RES/wordle-warm" ;;
    system_cold) run system_cold python3 bench/wordle_gpu_run.py --engine vllm \
      --run-dir "$RES/wordle-vllm" "${WORDLE[@]}" --result ;;
    system_hf) run system_hf python3 bench/wordle_gpu_run.py --engine transformers \
      --run-dir "$RES/wordle-hf" "${WORDLE[@]}" --result ;;
    system_2gpu) run system_2gpu python3 bench/wordle_gpu_run.py --engine vllm \
      --worker-gpus 0 1 --gpu-memory-utilization 0.5 --run-dir "$RES/wordle-vllm-2gpu" \
      "${WORDLE[@]}" --result ;;
    system_fsdp) run system_fsdp python3 bench/wordle_gpu_run.py --engine vllm --trainer-nproc 2 \
      --set 'trainer.parallel="fsdp"' --worker-gpus 2 3 --gpu-memory-utilization 0.3 \
      --run-dir "$RES/wordle-vllm-fsdp" "${WORDLE[@]}" --result ;;
    tp) run tp python3 bench/vllm_tp.py ${DELTARL_TP_REUSE:+--reuse "$DELTARL_TP_REUSE"} ;;
    teacher) run teacher python3 bench/teacher_vllm_check.py
      run teacher_fp32 python3 bench/teacher_vllm_check.py --dtype float32 ;;
    tests_tp) run tests_tp timeout 540 python3 -m pytest -q -s -p no:cacheprovider -o faulthandler_timeout=200 \
      tests/rollout/test_vllm_gpu.py -k "tensor_parallel or score_batch" \
      tests/teacher/test_teacher_vllm.py tests/rollout/test_vllm_engine.py tests/rollout/test_vllm_shards.py ;;
    moe) run moe timeout 600 python3 -m pytest -q -s -p no:cacheprovider -o faulthandler_timeout=200 \
      tests/rollout/test_vllm_moe_gpu.py tests/rollout/test_vllm_moe.py ;;
    fp8) VLLM_USE_DEEP_GEMM=0 run fp8 timeout 600 python3 -m pytest -q -s -p no:cacheprovider \
      -o faulthandler_timeout=200 tests/rollout/test_vllm_fp8_gpu.py ;;
    fsdp_fp8_nccl) run fsdp_fp8_nccl timeout 300 python3 -m pytest -q -s -p no:cacheprovider \
      -o faulthandler_timeout=200 tests/trainer/test_fsdp_fp8.py -k cuda ;;
    fsdp7b_fp8) run fsdp7b_fp8 timeout 900 python3 -m torch.distributed.run --nproc_per_node 2 \
      bench/fsdp_publish_bench.py --preset 7b --steps "${DELTARL_FSDP_STEPS:-6}" --fp8 128 ;;
    fp8_capitals) AB=fp8 SEEDS="${DELTARL_SUITE_SEEDS:-0 1}" run fp8_capitals \
      bash bench/gpu_capitals_ab.sh "$RES/fp8-capitals" ;;
    moe_scale) run moe_scale timeout 900 python3 bench/moe_scale.py --layers "${DELTARL_MOE_LAYERS:-8}" \
      --ranks "${DELTARL_MOE_RANKS:-2}" --steps "${DELTARL_MOE_STEPS:-4}" --engine vllm \
      --gpu-memory-utilization "${DELTARL_MOE_GPU_MEM:-0.45}" ;;
    moe_scale_fp8) run moe_scale_fp8 timeout 900 python3 bench/moe_scale.py --layers "${DELTARL_MOE_LAYERS:-8}" \
      --ranks "${DELTARL_MOE_RANKS:-2}" --steps "${DELTARL_MOE_STEPS:-4}" --engine vllm --fp8 \
      --gpu-memory-utilization "${DELTARL_MOE_GPU_MEM:-0.45}" ;;
    system_moe) run system_moe python3 bench/wordle_gpu_run.py --engine vllm --model-kind smollm2-moe \
      --trainer-nproc 2 --set 'trainer.parallel="fsdp"' --worker-gpus 2 3 --gpu-memory-utilization 0.3 \
      --run-dir "$RES/wordle-vllm-moe-fsdp" "${WORDLE[@]}" --result ;;
    system_moe_r3) run system_moe_r3 python3 bench/wordle_gpu_run.py --engine vllm --model-kind smollm2-moe \
      --trainer-nproc 2 --set 'trainer.parallel="fsdp"' --set 'run.routing_replay=true' \
      --worker-gpus 2 3 --gpu-memory-utilization 0.3 \
      --run-dir "$RES/wordle-vllm-moe-fsdp-r3" "${WORDLE[@]}" --result ;;
    system_moe_1gpu) run system_moe_1gpu python3 bench/wordle_gpu_run.py --engine vllm \
      --model-kind smollm2-moe --gpu-memory-utilization 0.3 --run-dir "$RES/wordle-vllm-moe" \
      "${WORDLE[@]}" --result ;;
    system_moe_1gpu_r3) run system_moe_1gpu_r3 python3 bench/wordle_gpu_run.py --engine vllm \
      --model-kind smollm2-moe --set 'run.routing_replay=true' --gpu-memory-utilization 0.3 \
      --run-dir "$RES/wordle-vllm-moe-r3" "${WORDLE[@]}" --result ;;
    system_moe_1gpu_s0) run system_moe_1gpu_s0 python3 bench/wordle_gpu_run.py --engine vllm \
      --model-kind smollm2-moe --set 'run.max_staleness=0' --gpu-memory-utilization 0.2 \
      --run-dir "$RES/wordle-vllm-moe-s0" "${WORDLE[@]}" --result ;;
    faults) DELTARL_TEST_ROLLOUT_ENGINE=vllm DELTARL_TEST_TIMEOUT_SCALE=4 DELTARL_FAULTS_SUMMARY="$RES/faults.json" \
      run faults python3 -m pytest -q -s -p no:cacheprovider \
      tests/faults/test_process_faults.py -k mid_episode_and_mid_sync ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
# the test steps' outcomes, merged into bench/results/gpu_tests_<gpus>_vllm.json
logs=()
for step in tests prefix faults tests_tp moe fp8 fsdp_fp8_nccl; do
  [ -f "$RES/$step.log" ] && logs+=("$RES/$step.log")
done
[ ${#logs[@]} -gt 0 ] && python3 bench/gpu_tests_result.py "${logs[@]}"
# the result files this run wrote, beside its logs (to take away from a machine in one folder)
mkdir -p "$RES/results"
find bench/results -maxdepth 1 -type f -newer "$RES/.started" -exec cp {} "$RES/results/" \;
echo "suite done" >>"$RES/status"
