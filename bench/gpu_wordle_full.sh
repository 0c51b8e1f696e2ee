#!/usr/bin/env bash
# The whole Wordle experiment on one GPU machine, in one go (docs/wordle.md, "The GPU recipe"):
# SmolLM2-135M-Instruct, the full 6-guess game, real rules (dictionary words).
#
#   bash bench/gpu_wordle_full.sh RESULTS_DIR
#
# Three GPUs visible (CUDA_VISIBLE_DEVICES set by the caller): the SFT and the GRPO trainer on
# the first, two vLLM rollout workers on the second and third. About 20 minutes:
#   1. solver games: python -m deltarl.env_server.wordle.transcripts, GAMES games in PAR processes; the
#      solver's own win rate in 6 guesses over those seeds (pipeline.json)
#   2. deltarl sft of SmolLM2 on them (first GPU), meanwhile `deltarl eval` plays EVAL_GAMES
#      greedy games with the untrained model (second GPU)
#   3. `deltarl eval` with the SFT model
#   4. GRPO from the SFT model through the whole system: bench/wordle_gpu_run.py --engine vllm
#      --worker-gpus 1 2, shaped reward, for DURATION seconds of training (default 780: the
#      win rate rises over ~220 steps, not visibly in ~100)
#   5. the final policy (the run's last version, rebuilt from its bucket) played by
#      `deltarl eval`
# RESULTS_DIR gets 8 files: status.txt (one line per stage: rc, seconds), pipeline.json (solver
# and SFT numbers), eval_untrained.json, eval_sft.json, eval_grpo.json, grpo_summary.json,
# reward.png and logs.tar.gz (every stage's log, the run's service logs, trainer metrics, sync
# logs, the SFT losses). Work files (transcripts, models, the bucket) stay in WORK_DIR.
#
# deltarl must be installed (pip install -e '.[all]') and vLLM 0.33.0 importable:
#   CUDA_VISIBLE_DEVICES=0,1,2 bash bench/gpu_wordle_full.sh RESULTS_DIR
#
# SMOKE=1: the same pipeline in a minute or two on a CPU (tiny model, a few games and steps,
# the transformers engine, one worker), to check that each stage hands its output to the next.
# Every knob below can be set from the environment. STAGES="prep" runs stages 1-3, STAGES="grpo"
# stages 4-5 on prep's WORK_DIR and RESULTS_DIR (two runs of ~4 and ~10 minutes instead of one).
set -uo pipefail
RES=${1:?results directory}
mkdir -p "$RES"
RES=$(cd "$RES" && pwd)
export PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1
# ... which also keeps bench/ off sys.path: the scripts import bench/common.py as `common`
export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)

if [ "${SMOKE:-0}" = 1 ]; then
  MODEL_KIND=${MODEL_KIND:-tiny} GAMES=${GAMES:-24} PAR=${PAR:-2}
  SFT_STEPS=${SFT_STEPS:-3} SFT_BATCH=${SFT_BATCH:-4} SFT_LR=${SFT_LR:-1e-4} SFT_DEVICE=cpu
  SFT_PRECISION=fp32 EVAL_GAMES=${EVAL_GAMES:-3} EVAL_DEVICE=cpu DURATION=${DURATION:-45}
  RUN_ARGS=(--engine transformers --device cpu --workers 1 --group-size 2 --groups-per-step 1
    --in-flight-groups 1 --max-guesses 2 --max-invalid 1 --window 2 --env-window-s 10)
  EVAL_GUESSES=2
  EVAL_GPU_UNTRAINED=""
else
  MODEL_KIND=${MODEL_KIND:-smollm2} GAMES=${GAMES:-4000} PAR=${PAR:-16}
  SFT_STEPS=${SFT_STEPS:-600} SFT_BATCH=${SFT_BATCH:-32} SFT_LR=${SFT_LR:-5e-5}
  SFT_DEVICE=cuda:0 SFT_PRECISION=bf16 EVAL_GAMES=${EVAL_GAMES:-200} EVAL_DEVICE=cuda:0
  DURATION=${DURATION:-780}
  read -ra WGPUS <<<"${WORKER_GPUS:-1 2}"
  RUN_ARGS=(--engine vllm --worker-gpus "${WGPUS[@]}" --workers "${#WGPUS[@]}"
    --gpu-memory-utilization "${GPU_MEM_UTIL:-0.5}"
    --group-size "${GROUP_SIZE:-8}" --groups-per-step "${GROUPS_PER_STEP:-8}" --in-flight-groups 8
    --max-guesses 6 --max-invalid 1 --window 10 --env-window-s 60
    --micro-batch-size "${MICRO_BATCH:-16}" ${MICRO_TOKENS:+--micro-batch-tokens "$MICRO_TOKENS"})
  # the trainer's memory comes back to the GPU between micro-batches of different lengths
  # (without it a trainer beside its vLLM worker on an 80 GB GPU runs out of memory)
  export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
  EVAL_GUESSES=6
  # the untrained model's eval beside the SFT; empty: after it, on EVAL_DEVICE (one GPU)
  EVAL_GPU_UNTRAINED=${EVAL_GPU_UNTRAINED-cuda:1}
fi
GRPO_LR=${GRPO_LR:-1e-5}
MAX_NEW=${MAX_NEW_TOKENS:-12}
WORK=${WORK_DIR:-$RES/../wordle-work}
mkdir -p "$WORK" "$RES/logs"
WORK=$(cd "$WORK" && pwd)
CACHE=${CACHE_DIR:-$HOME/.cache/deltarl/demo}
# the GRPO run's game: real rules (dictionary words), one tolerated invalid move; REWARD=shaped
# (default: win, greens, yellows, format, repetition and invalid terms on every move),
# REWARD=win (1 for a win, else 0: the cleaner signal once moves are valid, as TRL's Wordle
# example found) or REWARD=consistent (the shaped weights plus env.shaping_consistent=0.3: every
# valid guess after the first that is consistent with all the feedback so far earns 0.3, the
# skill the shaped run did not learn; docs/wordle.md, "Reward shaping"); GRPO_MODEL: the model GRPO starts from (default: the SFT model; e.g. the
# previous run's final policy, $WORK_DIR/final-policy, for a second stage); GRPO_NAME: the
# run's directory under WORK_DIR (default grpo; its final policy goes to final-policy, else
# final-$GRPO_NAME), so several GRPO arms can start from one prep; WORKER_GPUS: the vLLM
# workers' GPUs (default "1 2"); EXTRA_SETS: more --set overrides for the run (e.g. hints, or
# "--set trainer.loss.kl_coef=0.05" for a KL term to the model GRPO starts from); GROUP_SIZE and
# GROUPS_PER_STEP: games per group (default 8) and groups per step (default 8); GPU_MEM_UTIL: each vLLM
# worker's share of its GPU (default 0.5 on GPUs of its own; bench/gpu_wordle_arms.sh, whose
# workers share a GPU with their trainer, passes 0.25, 0.15 with two arms); FILL_UNPLAYED=false: a
# win earns nothing for its unplayed guesses (the plain sum of the per-move terms);
# RESULT=1: the GRPO run also writes its summary as the system benchmark's result
# (bench/results/system_<gpus>_smollm2-135m-sft-vllm.json, rendered by bench/report.py);
# MICRO_BATCH: the trainer's sequences per forward/backward pass (default 16), MICRO_TOKENS: also
# at most this many padded tokens per pass (default: no bound); SUMMARY=1 (the default): every
# feedback also states what all the feedback so far shows (env.feedback_summary) in the solver
# games, the evaluations and the run alike (one prep serves one rendering), SUMMARY=0 the plain
# feedback
SHAPED=(--set env.allow_non_words=false --set 'env.reward="shaped"'
  --set env.shaping_win=1.0 --set env.shaping_greens=0.2 --set env.shaping_yellows=0.1
  --set env.shaping_format=0.05 --set env.shaping_repetition=0.2 --set env.shaping_invalid=0.1
  --set "env.shaping_fill_unplayed=${FILL_UNPLAYED:-true}")
case ${REWARD:-shaped} in
  shaped) SHAPING=("${SHAPED[@]}") ;;
  consistent) SHAPING=("${SHAPED[@]}" --set env.shaping_consistent=0.3) ;;
  win) SHAPING=(--set env.allow_non_words=false --set 'env.reward="final"'
    --set env.partial_credit=0.0 --set env.format_credit=0.0) ;;
  *) echo "REWARD must be shaped, consistent or win, not ${REWARD}" >&2; exit 2 ;;
esac
SUMMARY_ARG=()
if [ "${SUMMARY:-1}" = 1 ]; then
  SUMMARY_ARG=(--feedback-summary)
  SHAPING+=(--set env.feedback_summary=true)
fi
EVAL=("${SUMMARY_ARG[@]}" --games "$EVAL_GAMES" --max-guesses "$EVAL_GUESSES" --max-invalid 1
  --max-new-tokens "$MAX_NEW" --temperature 0 --also-temperature "${TEMPERATURE:-1.0}"
  --cache-dir "$CACHE")

STAGES=${STAGES:-prep grpo}
want() { [[ " $STAGES " == *" $1 "* ]]; }

stage() {  # stage NAME COMMAND...: log to logs/NAME.log, one line in status.txt
  local name=$1
  shift
  echo "=== $name: $*" >"$RES/logs/$name.log"
  local t0=$SECONDS
  "$@" >>"$RES/logs/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $((SECONDS - t0))s" | tee -a "$RES/status.txt"
  return $rc
}

solver_games() {  # PAR processes of GAMES/PAR games each, seeds 0..GAMES-1, then one file
  local per=$(((GAMES + PAR - 1) / PAR)) pids=() i
  for ((i = 0; i < PAR; i++)); do
    "$PY" -m deltarl.env_server.wordle.transcripts --games "$per" --seed $((i * per)) --max-guesses 6 \
      "${SUMMARY_ARG[@]}" --out "$WORK/solver.$i.jsonl" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || return 1; done
  cat "$WORK"/solver.*.jsonl >"$WORK/solver.jsonl" && rm -f "$WORK"/solver.*.jsonl
}

echo "start $(date -u +%FT%TZ) smoke=${SMOKE:-0} stages=$STAGES" >>"$RES/status.txt"
T0=$SECONDS
finish() {  # pipeline.json and logs.tar.gz, also after a failed stage
  local rc=$?
  "$PY" - "$WORK" "$RES" <<'EOF' >"$RES/pipeline.json"
import json, statistics, sys
from pathlib import Path
work, res = Path(sys.argv[1]), Path(sys.argv[2])
out = {}
solver = work / "solver.jsonl"
games = [json.loads(x) for x in solver.read_text().splitlines() if x.strip()] if solver.exists() else []
won = [g for g in games if g["won"]]
if games:
    out["solver"] = {
        "games": len(games), "seeds": [min(g["seed"] for g in games), max(g["seed"] for g in games)],
        "max_guesses": games[0]["max_guesses"], "win_rate": len(won) / len(games),
        "mean_guesses": statistics.fmean(g["guesses"] for g in games),
        "mean_guesses_won": statistics.fmean(g["guesses"] for g in won) if won else None}
sft = work / "sft" / "sft.json"
if sft.exists():
    s = json.loads(sft.read_text())
    losses = s["losses"]
    out["sft"] = {"settings": s["settings"], "transcripts": s["transcripts"], "steps": len(losses),
                  "loss_first10": statistics.fmean(losses[:10]),
                  "loss_last10": statistics.fmean(losses[-10:])}
for name in ("untrained", "sft", "grpo"):
    p = res / f"eval_{name}.json"
    if p.exists():
        e = json.loads(p.read_text())
        out[f"eval_{name}"] = {k: e.get(k) for k in (
            "valid_move_rate", "win_rate", "greens_per_guess", "yellows_per_guess", "consistent_rate",
            "mean_guesses", "forfeit_rate", "version")}
        if "sampled" in e:
            out[f"eval_{name}"]["sampled"] = {k: e["sampled"].get(k) for k in (
                "temperature", "valid_move_rate", "win_rate", "greens_per_guess", "consistent_rate",
                "mean_guesses")}
p = res / "grpo_summary.json"
if p.exists():
    s = json.loads(p.read_text())
    out["grpo"] = {"steps": s.get("steps"), "elapsed_s": s.get("elapsed_s"),
                   "first_vs_last_window": s.get("first_vs_last_window"), "wordle": s.get("wordle")}
print(json.dumps(out, indent=1))
EOF

  # everything small of the run, in one tarball (not the bucket, checkpoints or models)
  cp "$WORK/sft/sft.json" "$RES/logs/sft_losses.json" 2>/dev/null
  # an earlier part's logs (STAGES=grpo after STAGES=prep) stay in the tarball
  [ -f "$RES/logs.tar.gz" ] && tar xzf "$RES/logs.tar.gz" -C "$RES" --skip-old-files logs
  local run=${GRPO_NAME:-grpo}
  (cd "$WORK" && find "$run" -type f \( -name '*.log' -o -name '*.jsonl' -o -name '*.json' \) \
    -not -path "$run/bucket/*" -not -path '*checkpoint*' -size -20M -print0 2>/dev/null |
    tar --null -czf "$RES/logs.tar.gz" -T - -C "$RES" logs)
  rm -rf "$RES/logs"
  echo "total $((SECONDS - T0))s exit=$rc" | tee -a "$RES/status.txt"
  ls -la "$RES"
}
trap finish EXIT

if want prep; then
  stage model "$PY" -c "from pathlib import Path; from deltarl.services.common.models import prepare_model; \
print(prepare_model('$MODEL_KIND', Path('$CACHE')))" || exit 1
  BASE=$(tail -n 1 "$RES/logs/model.log")
  stage solver solver_games || exit 1

  # 2. SFT on the first GPU while the untrained model plays on the second
  if [ -n "$EVAL_GPU_UNTRAINED" ]; then
    stage eval_untrained "$PY" -m deltarl eval --model "$BASE" --label untrained \
      --device "$EVAL_GPU_UNTRAINED" --out "$RES/eval_untrained.json" "${EVAL[@]}" &
    UNTRAINED=$!
  fi
  stage sft "$PY" -m deltarl sft --set "model=$BASE" --set "data=$WORK/solver.jsonl" \
    --set "out=$WORK/sft" --set "steps=$SFT_STEPS" --set "batch_size=$SFT_BATCH" \
    --set "lr=$SFT_LR" --set "device=$SFT_DEVICE" --set "precision=$SFT_PRECISION" || exit 1
  if [ -n "$EVAL_GPU_UNTRAINED" ]; then
    wait "$UNTRAINED"
  else
    stage eval_untrained "$PY" -m deltarl eval --model "$BASE" --label untrained \
      --device "$EVAL_DEVICE" --out "$RES/eval_untrained.json" "${EVAL[@]}"
  fi

  # 3. the SFT model
  stage eval_sft "$PY" -m deltarl eval --model "$WORK/sft" --label sft \
    --device "$EVAL_DEVICE" --out "$RES/eval_sft.json" "${EVAL[@]}"
fi
if want grpo; then
  # 4. GRPO from the SFT model, the whole system on loopback
  NAME=${GRPO_NAME:-grpo}
  FINAL=$WORK/final-policy
  [ "$NAME" = grpo ] || FINAL=$WORK/final-$NAME
  rm -rf "${WORK:?}/$NAME"
  GRPO_FROM=${GRPO_MODEL:-$WORK/sft}
  if [ "$GRPO_FROM" = "$FINAL" ]; then  # eval_grpo rewrites it: start from a copy
    rm -rf "$WORK/$NAME-start" && cp -r "$GRPO_FROM" "$WORK/$NAME-start" && GRPO_FROM=$WORK/$NAME-start
  fi
  read -ra EXTRA <<<"${EXTRA_SETS:-}"
  stage grpo "$PY" "$HERE/wordle_gpu_run.py" --run-dir "$WORK/$NAME" --model "$GRPO_FROM" \
    --cache-dir "$CACHE" --duration "$DURATION" --lr "$GRPO_LR" --max-new-tokens "$MAX_NEW" \
    --set "run.temperature=${TEMPERATURE:-1.0}" ${RESULT:+--result} \
    "${RUN_ARGS[@]}" "${SHAPING[@]}" "${EXTRA[@]}"
  cp "$WORK/$NAME/summary.json" "$RES/grpo_summary.json" 2>/dev/null
  cp "$WORK/$NAME/reward.png" "$RES/reward.png" 2>/dev/null

  # 5. the final policy, rebuilt from the run's bucket
  stage eval_grpo "$PY" -m deltarl eval --model "$GRPO_FROM" --label grpo \
    --export-from "$WORK/$NAME" --export-to "$FINAL" \
    --device "$EVAL_DEVICE" --out "$RES/eval_grpo.json" "${EVAL[@]}"
fi
