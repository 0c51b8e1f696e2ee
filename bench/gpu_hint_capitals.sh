#!/usr/bin/env bash
# Hinted self-distillation on a GPU, capitals task: the default demo's task (the charset env with
# target A-Z, SmolLM2-135M-Instruct asked to reply in capital letters) through the whole system
# (coordinator, env, 2 transformers workers, trainer on one GPU), GRPO alone vs GRPO + the
# environment's hints (rollout hint_mode=env, trainer loss.hint_coef), same seeds and steps,
# seeds one after another; then RES/summary.json: per arm and seed the trained batches' mean
# reward per step, the mean of the last LAST steps, and hints minus GRPO (rewritten after every
# run), also written with the date, machine and command to
# bench/results/hints_capitals_<gpu>_smollm2-135m.json. About 1 min per run on one H100.
#   [SEEDS="0 1 2"] [STEPS=15] [LAST=5] [HINT_COEF=5.0] bash bench/gpu_hint_capitals.sh RES
set -uo pipefail
RES=${1:?results directory}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-15}
LAST=${LAST:-5}
HINT_COEF=${HINT_COEF:-5.0}
mkdir -p "$RES"
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# ... which also keeps bench/ off sys.path: the scripts import bench/common.py as `common`
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
COMMON=(--task charset --set 'env.charset_target="ABCDEFGHIJKLMNOPQRSTUVWXYZ"'
  --engine transformers --max-turns 1 --max-new-tokens 24 --group-size 6 --groups-per-step 2
  --in-flight-groups 1 --lr 1e-4 --warmup 0 --steps "$STEPS" --duration 900 --anchor-every 0
  --set 'trainer.optimizer.weight_decay=0.0' --set 'rollout.submit_timeout_s=60.0')
CMD="SEEDS=\"$SEEDS\" STEPS=$STEPS LAST=$LAST HINT_COEF=$HINT_COEF bash bench/gpu_hint_capitals.sh RES"
summarise() {
python3 - "$RES" "$SEEDS" "$LAST" "$CMD" <<'PY'
import json, sys
from pathlib import Path
from statistics import mean

sys.path.insert(0, "bench")
from common import gpu_tag, meta, result_path, write_json

res, seeds, last = Path(sys.argv[1]), sys.argv[2].split(), int(sys.argv[3])
out = {"last": last, "seeds": {}}
for seed in seeds:
    row = {}
    for arm in ("grpo", "hints"):
        path = res / f"{arm}-{seed}" / "trainer" / "metrics.jsonl"
        rows = [json.loads(x) for x in path.open()] if path.exists() else []
        rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
        hint = [r["hint/loss"] for r in rows if "hint/loss" in r]
        row[arm] = {
            "rewards": [round(x, 4) for x in rewards],
            "last_mean": round(mean(rewards[-last:]), 4) if rewards else None,
            "hint_loss_steps": len(hint),
        }
    g, h = row["grpo"]["last_mean"], row["hints"]["last_mean"]
    row["hints_minus_grpo"] = round(h - g, 4) if g is not None and h is not None else None
    out["seeds"][seed] = row
diffs = [r["hints_minus_grpo"] for r in out["seeds"].values() if r["hints_minus_grpo"] is not None]
out["mean_hints_minus_grpo"] = round(mean(diffs), 4) if diffs else None
out["hints_ahead_on"] = sum(d > 0 for d in diffs)
(res / "summary.json").write_text(json.dumps(out, indent=1) + "\n")
about = meta(gpus=1) | {"command": sys.argv[4]}
write_json(result_path("hints_capitals", gpu_tag(1), "smollm2-135m"), {"meta": about, **out})
print(json.dumps(out, indent=1))
PY
}
for seed in $SEEDS; do
  for arm in grpo hints; do
    extra=()
    [ "$arm" = hints ] && extra=(--set 'rollout.hints.mode="env"'
      --set "trainer.loss.hint_coef=$HINT_COEF")
    t0=$SECONDS
    python3 bench/wordle_gpu_run.py --run-dir "$RES/$arm-$seed" --seed "$seed" "${COMMON[@]}" \
      "${extra[@]}" >"$RES/$arm-$seed.log" 2>&1
    echo "$arm-$seed rc=$? $((SECONDS - t0))s" >>"$RES/status"
    summarise >/dev/null  # after every run: a run cut short keeps what it measured
  done
done
summarise
echo "done" >>"$RES/status"
