#!/usr/bin/env bash
# The FSDP2 publication scaling curve on one node (bench/fsdp_publish_bench.py): 0.6b, 1.7b, 7b,
# 14b back to back, one torchrun each under a time limit (below), each writing
# RESULTS_DIR/fsdp_publish_<preset>_<N>gpu.jsonl (one JSON line per step, then a summary line; a
# preset that fails, e.g. out of GPU memory, leaves one {"failed": ...} line and the next preset
# runs) and, when it completes, its result in bench/results/fsdp_publish_<N>x<gpu>_<preset>.jsonl.
#
#   bash bench/fsdp_scaling.sh RESULTS_DIR [NPROC]
#
# Environment: PYTHON (default python), PRESETS (default "0.6b 1.7b 7b 14b"), EXTRA (more bench
# flags for every preset), STEPS_7B (the 7b preset's steps, default 6; 10 needs LIMIT_7B=300).
set -u
out=${1:?usage: fsdp_scaling.sh RESULTS_DIR [NPROC]}
nproc=${2:-4}
py=${PYTHON:-python}
presets=${PRESETS:-"0.6b 1.7b 7b 14b"}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
# seconds per preset (model build, anchor, the published steps, the follower's apply); 14b
# publishes without the follower (its apply is the 7b one's, twice the size)
declare -A limit=([0.6b]=60 [1.7b]=90 [7b]=${LIMIT_7B:-240} [14b]=150)
declare -A steps=([0.6b]=4 [1.7b]=4 [7b]=${STEPS_7B:-6} [14b]=3)
declare -A follow=([0.6b]=--apply [1.7b]=--apply [7b]=--apply [14b]=)
port=29611
for p in $presets; do
    file="$out/fsdp_publish_${p}_${nproc}gpu.jsonl"
    log="$out/fsdp_publish_${p}_${nproc}gpu.log"
    port=$((port + 1))
    echo "== $p: ${steps[$p]:-3} steps, limit ${limit[$p]:-120} s -> $file" >&2
    start=$(date +%s)
    timeout -k 15 "${limit[$p]:-120}" "$py" -m torch.distributed.run --nproc_per_node "$nproc" \
        --master_port "$port" "$here/fsdp_publish_bench.py" --preset "$p" \
        --steps "${steps[$p]:-3}" ${follow[$p]---apply} ${EXTRA:-} >"$file" 2>"$log"
    rc=$?
    if [ $rc -ne 0 ] && ! grep -q '"failed"' "$file"; then
        reason="exit $rc"
        [ $rc -eq 124 ] && reason="timeout after ${limit[$p]:-120} s"
        grep -qi "out of memory" "$log" && reason="OOM ($reason)"
        echo "{\"preset\": \"$p\", \"failed\": \"$reason\"}" >>"$file"
    fi
    echo "== $p: rc $rc in $(($(date +%s) - start)) s" >&2
    grep -h '"summary"\|"failed"' "$file" >&2
done
