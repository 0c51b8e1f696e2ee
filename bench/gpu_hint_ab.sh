#!/usr/bin/env bash
# Hinted self-distillation on a GPU, A/B in one lease (issue 15): the whole system (coordinator,
# env, 2 transformers workers, trainer; SmolLM2-135M-Instruct on 6-guess Wordle) without hints,
# then with the environment's hints (rollout hint_mode=env, trainer loss.hint_coef=1), same seed.
#   [ARMS="plain hints"] bash bench/gpu_hint_ab.sh RESULTS_DIR [SECONDS]
set -uo pipefail
RES=${1:?results directory}
S=${2:-240}
mkdir -p "$RES"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
COMMON=(--engine transformers --max-guesses 6 --max-invalid 1 --max-new-tokens 24
  --reward final --format-credit 0.5 --lr 1e-5 --duration "$S" --seed 0)
for arm in ${ARMS:-plain hints}; do
  extra=()
  [ "$arm" = hints ] && extra=(--set 'rollout.hint_mode="env"' --set 'trainer.loss.hint_coef=1.0')
  t0=$SECONDS
  python3 bench/wordle_gpu_run.py --run-dir "$RES/$arm" "${COMMON[@]}" "${extra[@]}" \
    >"$RES/$arm.log" 2>&1
  echo "$arm rc=$? $((SECONDS - t0))s" >>"$RES/status"
done
echo "done" >>"$RES/status"
