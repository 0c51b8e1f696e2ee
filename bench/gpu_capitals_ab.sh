#!/usr/bin/env bash
# Two arms on the capitals task, same seeds and steps, on one GPU: the default demo's task (the
# charset env with target A-Z, SmolLM2-135M-Instruct asked to reply in capital letters) through
# the whole system (coordinator, env, workers, trainer). AB picks the comparison:
#   AB=hints  GRPO alone vs GRPO + the environment's hints (rollout hint_mode=env, trainer
#             loss.hint_coef), 2 transformers workers, seeds one after another, arms in turn
#             -> bench/results/hints_capitals_<gpu>_smollm2-135m.json (bench/gpu_hint_capitals.sh)
#   AB=fp8    bf16 vs block-fp8 vllm workers (run.fp8, 64 x 64 blocks: SmolLM2's projections
#             are not whole 128-row blocks), 1 worker per run; the two arms of a seed run side by
#             side on the GPU (learning is compared per step, not per second)
#             -> bench/results/fp8_capitals_<gpu>_smollm2-135m.json
# RES/summary.json holds, per arm and seed, the trained batches' mean reward per step, the mean
# of the last LAST steps, the median over steps of the trainer-vs-worker logprob gap
# (mismatch/abs_logprob_diff/mean) and of the importance weight, and arm B minus arm A; it is
# rewritten after every run and also written with the date, machine and command to the result.
#   AB=fp8 [SEEDS="0 1 2"] [STEPS=15] [LAST=5] [HINT_COEF=5.0] bash bench/gpu_capitals_ab.sh RES
set -uo pipefail
RES=${1:?results directory}
AB=${AB:?AB=hints or AB=fp8}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-15}
LAST=${LAST:-5}
HINT_COEF=${HINT_COEF:-5.0}
mkdir -p "$RES"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# ... which also keeps bench/ off sys.path: the scripts import bench/common.py as `common`
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
COMMON=(--task charset --set 'env.charset_target="ABCDEFGHIJKLMNOPQRSTUVWXYZ"'
  --max-turns 1 --max-new-tokens 24 --group-size 6 --groups-per-step 2
  --in-flight-groups 1 --lr 1e-4 --warmup 0 --steps "$STEPS" --duration 900 --anchor-every 0
  --set 'trainer.optimizer.weight_decay=0.0' --set 'rollout.submit_timeout_s=60.0')
case $AB in
  hints) ARMS=(grpo hints); PARALLEL=0; COMMON+=(--engine transformers)
    CMD="HINT_COEF=$HINT_COEF SEEDS=\"$SEEDS\" STEPS=$STEPS LAST=$LAST bash bench/gpu_hint_capitals.sh RES" ;;
  fp8) ARMS=(bf16 fp8); PARALLEL=1
    COMMON+=(--engine vllm --workers 1 --gpu-memory-utilization 0.1)
    CMD="AB=fp8 SEEDS=\"$SEEDS\" STEPS=$STEPS LAST=$LAST bash bench/gpu_capitals_ab.sh RES" ;;
  *) echo "AB=$AB: hints or fp8" >&2; exit 2 ;;
esac
arm_args() {  # what arm $1 adds to COMMON
  case $1 in
    hints) echo --set 'rollout.hints.mode="env"' --set "trainer.loss.hint_coef=$HINT_COEF" ;;
    fp8) echo --set run.fp8=true --set run.fp8_block=64 ;;
  esac
}
summarise() {
python3 - "$RES" "$SEEDS" "$LAST" "$CMD" "$AB" "${ARMS[@]}" <<'PY'
import json, sys
from pathlib import Path
from statistics import mean, median

sys.path.insert(0, "bench")
from common import gpu_tag, meta, result_path, write_json

res, seeds, last, command, ab = Path(sys.argv[1]), sys.argv[2].split(), int(sys.argv[3]), sys.argv[4], sys.argv[5]
a, b = sys.argv[6:8]
out = {"arms": [a, b], "last": last, "seeds": {}}
for seed in seeds:
    row = {}
    for arm in (a, b):
        path = res / f"{arm}-{seed}" / "trainer" / "metrics.jsonl"
        rows = [json.loads(x) for x in path.open()] if path.exists() else []
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
        gaps = [r[k] for r in rows if (k := "mismatch/abs_logprob_diff/mean") in r]
        weights = [r[k] for r in rows if (k := "is/weight/mean") in r]
        row[arm] = {
            "rewards": [round(x, 4) for x in rewards],
            "last_mean": round(mean(rewards[-last:]), 4) if rewards else None,
            "logprob_gap_median": round(median(gaps), 4) if gaps else None,
            "is_weight_median": round(median(weights), 4) if weights else None,
        }
        if arm == "hints":
            row[arm]["hint_loss_steps"] = sum("hint/loss" in r for r in rows)
    x, y = row[a]["last_mean"], row[b]["last_mean"]
    row[f"{b}_minus_{a}"] = round(y - x, 4) if x is not None and y is not None else None
    out["seeds"][seed] = row
diffs = [r[f"{b}_minus_{a}"] for r in out["seeds"].values() if r[f"{b}_minus_{a}"] is not None]
out[f"mean_{b}_minus_{a}"] = round(mean(diffs), 4) if diffs else None
out[f"{b}_ahead_on"] = sum(d > 0 for d in diffs)
(res / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
about = meta(gpus=1) | {"command": command}
write_json(result_path(f"{ab}_capitals", gpu_tag(1), "smollm2-135m"), {"meta": about, **out})
print(json.dumps(out, indent=1))
PY
}
run_arm() {  # arm seed; a run that fails is run once more (vLLM's start-up memory check fails
  # when another process on the GPU frees memory while it profiles)
  local t0 rc
  for attempt in 1 2; do
    t0=$SECONDS
    rm -rf "$RES/$1-$2"
    # shellcheck disable=SC2046  # arm_args prints separate words
    python3 bench/wordle_gpu_run.py --run-dir "$RES/$1-$2" --seed "$2" "${COMMON[@]}" \
      $(arm_args "$1") >"$RES/$1-$2.log" 2>&1
    rc=$?
    echo "$1-$2 rc=$rc $((SECONDS - t0))s (attempt $attempt)" >>"$RES/status"
    [ $rc = 0 ] && break
    cp "$RES/$1-$2.log" "$RES/$1-$2.failed.log"
  done
}
for seed in $SEEDS; do
  if [ "$PARALLEL" = 1 ]; then
    run_arm "${ARMS[0]}" "$seed" & sleep 5; run_arm "${ARMS[1]}" "$seed"; wait
  else
    for arm in "${ARMS[@]}"; do run_arm "$arm" "$seed"; done
  fi
  summarise >/dev/null  # after every seed: a run cut short keeps what it measured
done
summarise
echo "done" >>"$RES/status"
