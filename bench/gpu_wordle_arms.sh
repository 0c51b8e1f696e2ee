#!/usr/bin/env bash
# Wordle GRPO arms side by side (docs/wordle.md): one prep (solver games, SFT, the untrained and
# SFT evaluations) and then several GRPO arms from the same SFT model at once, each arm a trainer
# and its own vLLM worker on one GPU (two arms may share a GPU). Every arm is
# bench/gpu_wordle_full.sh with STAGES=grpo; the results land in RESULTS_DIR/<arm>/ (eval_*.json,
# pipeline.json, ...), and all of them, with the date, machine and command, in
# bench/results/wordle_grpo_<N>x<gpu>_smollm2-135m-<plain|summary>.json (bench/wordle_grpo_result.py).
#
#   bash bench/gpu_wordle_arms.sh RESULTS_DIR ARM...
#
# ARM: NAME@GPU, optionally followed by ':' and VAR=VALUE settings for bench/gpu_wordle_full.sh
# separated by ';' (values may hold spaces), e.g.:
#
#   DURATION=780 REWARD=consistent bash bench/gpu_wordle_arms.sh runs/w 'lr1@0' \
#     'lr3@1:GRPO_LR=3e-5' 'turn@2:EXTRA_SETS=--set trainer.loss.credit="turn"' \
#     'kl@3:EXTRA_SETS=--set trainer.loss.kl_coef=0.05'
#
# Environment: everything bench/gpu_wordle_full.sh reads (REWARD, DURATION, GRPO_LR, SFT_STEPS,
# ...) applies to the prep and to every arm unless the arm sets it; PREP=0 skips the prep
# (WORK_DIR already holds one); STAGGER (default 60 s): how long an arm waits for the one started
# before it on the same GPU (vLLM measures its GPU's memory while it starts); an arm's worker
# gets GPU_MEM_UTIL=0.25 of its GPU (0.15 with two arms on it) unless that is set.
# SMOKE=1: the same on a CPU in a few minutes.
set -uo pipefail
RES=${1:?results directory}
shift
[ $# -ge 1 ] || { echo "give at least one arm: NAME@GPU[:VAR=VALUE;...]" >&2; exit 2; }
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
export WORK_DIR=${WORK_DIR:-$RES/work}

declare -A per_gpu=()
names=() gpus=() settings=()
for spec in "$@"; do
  head=${spec%%:*}
  rest=""
  [[ "$spec" == *:* ]] && rest=${spec#*:}
  name=${head%@*}
  gpu=${head#*@}
  if [[ ! "$name" =~ ^[A-Za-z0-9_.-]+$ || ! "$gpu" =~ ^[0-9]+$ || "$head" != *@* ]]; then
    echo "bad arm '$spec': want NAME@GPU[:VAR=VALUE;...] (NAME of letters, digits, _ . -)" >&2
    exit 2
  fi
  if [[ " ${names[*]} " == *" $name "* ]]; then
    echo "arm name '$name' given twice" >&2
    exit 2
  fi
  names+=("$name") gpus+=("$gpu") settings+=("$rest")
  per_gpu[$gpu]=$((${per_gpu[$gpu]:-0} + 1))
done

if [ "${PREP:-1}" = 1 ]; then
  # the prep on the first arm's GPU (SFT) and the next one (the untrained model's eval)
  g0=${gpus[0]}
  g1=$g0
  for g in "${gpus[@]}"; do [ "$g" != "$g0" ] && g1=$g && break; done
  # every arm on one GPU: that GPU alone, the two evals one after the other (naming the GPU
  # twice in CUDA_VISIBLE_DEVICES would put the untrained model's eval on a cuda:1 that is absent)
  visible=("CUDA_VISIBLE_DEVICES=$g0,$g1")
  [ "$g1" = "$g0" ] && visible=("CUDA_VISIBLE_DEVICES=$g0" EVAL_GPU_UNTRAINED=)
  env "${visible[@]}" STAGES=prep bash "$HERE/gpu_wordle_full.sh" "$RES/prep" ||
    { echo "the prep failed: $RES/prep/status.txt" >&2; exit 1; }
fi

declare -A started=()
pids=()
for i in "${!names[@]}"; do
  name=${names[$i]} gpu=${gpus[$i]}
  if [ -n "${started[$gpu]:-}" ]; then sleep "${STAGGER:-60}"; fi
  started[$gpu]=1
  vars=()
  if [ -n "${settings[$i]}" ]; then IFS=';' read -ra vars <<<"${settings[$i]}"; fi
  # each arm's trainer shares its GPU with its vLLM worker: a quarter of an 80 GB card for the
  # worker (with half of it the trainer runs out of memory), less with two arms on it
  share=()
  if [ -z "${GPU_MEM_UTIL:-}" ]; then
    share=(GPU_MEM_UTIL=0.25)
    [ "${per_gpu[$gpu]}" -gt 1 ] && share=(GPU_MEM_UTIL=0.15)
  fi
  mkdir -p "$RES/$name"
  cp "$RES/prep/eval_untrained.json" "$RES/prep/eval_sft.json" "$RES/$name/" 2>/dev/null
  env CUDA_VISIBLE_DEVICES="$gpu" WORKER_GPUS=0 STAGES=grpo GRPO_NAME="$name" "${share[@]}" \
    "${vars[@]}" bash "$HERE/gpu_wordle_full.sh" "$RES/$name" >"$RES/$name.out" 2>&1 &
  pids+=($!)
  echo "arm $name on GPU $gpu: ${settings[$i]:-defaults} (pid ${pids[-1]})"
done
rc=0
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { rc=1; echo "arm ${names[$i]} failed: $RES/${names[$i]}/status.txt" >&2; }
done
for name in "${names[@]}"; do echo "== $name"; tail -n 3 "$RES/$name/status.txt"; done
if [ "${SMOKE:-0}" != 1 ]; then
  arms_cmd=$(printf " '%s'" "$@")
  settings=""
  for v in DURATION REWARD SUMMARY GRPO_LR SFT_STEPS; do
    [ -n "${!v:-}" ] && settings+="$v=${!v} "
  done
  python3 "$HERE/wordle_grpo_result.py" "$RES" --gpus "${#per_gpu[@]}" \
    --command "${settings}bash bench/gpu_wordle_arms.sh RES$arms_cmd" || rc=1
fi
exit $rc
