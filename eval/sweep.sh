#!/usr/bin/env bash
# Rebuild BENCHMARKS.md from nothing: quantize SmolLM2-135M with each recipe, measure quality (`specquant eval`)
# for every {weights} x {KV cache} and latency (`specquant bench`) for every {weights} x {KV cache} x {speculation},
# each as a hydra multirun appending to one results store, then `specquant report` writes BENCHMARKS.md, the Pareto
# PNG and the HTML page from that store.
#
#   eval/sweep.sh                       # the full sweep (run from the repository root)
#   QUICK=1 eval/sweep.sh               # a small version: two weight configs, fewer windows/items/tokens
#   STORE=/tmp/r.jsonl OUT=/tmp/bench eval/sweep.sh
#   EXTRA="engine.threads=1" eval/sweep.sh   # extra overrides for every eval and bench run
#
# Every result line holds its resolved config, protocol, machine facts and git revision; the store is appended to,
# so delete it first for a clean rebuild (the script does unless KEEP_STORE=1).
set -euo pipefail
export HF_HUB_OFFLINE=1
OUT=${OUT:-.}
STORE=${STORE:-$OUT/benchmarks/results.jsonl}
CHECKPOINTS=${SPECQUANT_HOME:-$HOME/.cache/specquant}/checkpoints
MODEL=smollm2-135m
if [[ ${QUICK:-0} == 1 ]]; then
  RECIPES=${RECIPES:-"rtn-w4g64"}
  KVS=${KVS:-"fp,int8"}
  SPECS=${SPECS:-"none"}
  EVAL_ARGS=(task=all max_windows=4 items=100 gen_prompts=2 gen_new_tokens=16)
  BENCH_ARGS=(prompt_tokens=128 new_tokens=32 n_prompts=2 repeats=1)
else
  RECIPES=${RECIPES:-"rtn-w8 rtn-w4g64 gptq-w4g64 awq-w4g64 gptq-w3g64"}
  KVS=${KVS:-"fp,int8,int4"}
  SPECS=${SPECS:-"none,lookup,self"}
  EVAL_ARGS=(task=all)
  BENCH_ARGS=(prompt_tokens=128 new_tokens=128)
fi
[[ ${KEEP_STORE:-0} == 1 ]] || rm -f "$STORE"
mkdir -p "$(dirname "$STORE")"

models=("$MODEL")
for recipe in $RECIPES; do
  dir=$CHECKPOINTS/$MODEL-$recipe
  [[ -f $dir/quant_manifest.json ]] || specquant quantize "recipe=$MODEL/$recipe" "output=$dir"
  models+=("$dir")
done

for model in "${models[@]}"; do
  specquant eval -m "model=$model" "kv=$KVS" "${EVAL_ARGS[@]}" "store=$STORE" ${EXTRA:-}
  specquant bench -m "model=$model" "kv=$KVS" "spec=$SPECS" "${BENCH_ARGS[@]}" "+store=$STORE" ${EXTRA:-}
done

specquant report "store=$STORE" "out=$OUT/BENCHMARKS.md" "png=$OUT/benchmarks.png" "html=$OUT/benchmarks.html"
specquant recommend max_ppl_increase=0.03 "store=$STORE"
