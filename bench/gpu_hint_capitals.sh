#!/usr/bin/env bash
# Hinted self-distillation on a GPU, capitals task: GRPO alone vs GRPO + the environment's hints,
# same seeds and steps (bench/gpu_capitals_ab.sh with AB=hints says what runs and what is
# written). About 1 min per run on one H100.
#   [SEEDS="0 1 2"] [STEPS=15] [LAST=5] [HINT_COEF=5.0] bash bench/gpu_hint_capitals.sh RES
AB=hints exec bash "$(dirname "$0")/gpu_capitals_ab.sh" "$@"
