#!/usr/bin/env bash
# Hinted self-distillation on a GPU, A/B on one machine: the whole system (coordinator, env, 2
# transformers workers, trainer; SmolLM2-135M-Instruct on 6-guess Wordle) without hints, then
# with the environment's hints (rollout hint_mode=env, trainer loss.hint_coef=1), same seed. Each
# arm's run lands in RESULTS_DIR/<arm>/; both arms' numbers, with the date, machine and command,
# in bench/results/hints_wordle_<gpu>_smollm2-135m.json.
#   [ARMS="plain hints"] bash bench/gpu_hint_ab.sh RESULTS_DIR [SECONDS]
set -uo pipefail
RES=${1:?results directory}
S=${2:-240}
mkdir -p "$RES"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# ... which also keeps bench/ off sys.path: the scripts import bench/common.py as `common`
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
COMMON=(--engine transformers --max-guesses 6 --max-invalid 1 --max-new-tokens 24
  --reward final --format-credit 0.5 --lr 1e-5 --duration "$S" --seed 0)
for arm in ${ARMS:-plain hints}; do
  extra=()
  [ "$arm" = hints ] && extra=(--set 'rollout.hints.mode="env"' --set 'trainer.loss.hint_coef=1.0')
  t0=$SECONDS
  python3 bench/wordle_gpu_run.py --run-dir "$RES/$arm" "${COMMON[@]}" "${extra[@]}" \
    >"$RES/$arm.log" 2>&1
  echo "$arm rc=$? $((SECONDS - t0))s" >>"$RES/status"
done
python3 - "$RES" "ARMS=\"${ARMS:-plain hints}\" bash bench/gpu_hint_ab.sh RES $S" <<'PY'
import json, sys
from pathlib import Path

sys.path.insert(0, "bench")
from common import gpu_tag, meta, result_path, write_json

res, out = Path(sys.argv[1]), {"meta": meta(gpus=1) | {"command": sys.argv[2]}}
for path in sorted(res.glob("*/summary.json")):
    s = json.loads(path.read_text())
    sync, status = s.get("sync") or {}, s.get("coordinator_status") or {}
    out[path.parent.name] = {
        "steps": s["steps"],
        "elapsed_s": s.get("train_s") or s["elapsed_s"],
        "episodes_trained_per_s": s.get("episodes_trained_per_s"),
        "worker_tokens_per_s": s.get("worker_tokens_per_s"),
        "pause_ms": sync.get("pause_ms"),
        "publish_to_applied_s": sync.get("publish_to_applied_s"),
        "all_workers_verified_at_final": status.get("all_workers_verified_at_final"),
        "per_step": s["per_step"],
    }
write_json(result_path("hints_wordle", gpu_tag(1), "smollm2-135m"), out)
PY
echo "done" >>"$RES/status"
