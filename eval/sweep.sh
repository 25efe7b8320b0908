#!/usr/bin/env bash
# Rebuild BENCHMARKS.md from nothing: quantize SmolLM2-135M with each recipe, measure quality (`specquant eval`)
# for every {weights} x {KV cache} and latency (`specquant bench`) for every {weights} x {KV cache} x
# {speculation}, each as a hydra multirun appending to one results store; then `specquant report` writes
# BENCHMARKS.md, the Pareto PNG and the HTML page (and screenshots it in headless Chromium when one is installed,
# eval/get_chromium.sh) from that store.
#
#   eval/sweep.sh                       # the full sweep (run from the repository root; ~50 min on 2 cores)
#   QUICK=1 eval/sweep.sh               # a small version: one recipe, fewer windows/items/tokens
#   STORE=/tmp/r.jsonl OUT=/tmp/bench eval/sweep.sh
#   EXTRA="engine.threads=1" eval/sweep.sh   # extra overrides for every eval and bench run
#
# The sweep's protocol, chosen to fit an hour on two cores (every result line also stores its own):
# - quantize: each recipe as written except calibration, 32 x 512 pydoc tokens (the recipes say 128).
# - quality, kv=fp: perplexity, KL and top-1 on 8 x 512-token windows; 200 cloze and 200 mc items (of the >= 500
#   built); greedy agreement on 4 prompts. The reference (fp32 float model) scores its cloze/mc items once and
#   keeps them on disk (toolkit/evaluation/reference_scores.py).
# - quality, kv=int8/int4: perplexity, KL and top-1 only, windows fed 128 tokens at a time so the quantized cache
#   is read back. Their cloze/mc/gen passages (<= 128 and 96 tokens) would sit entirely in the cache's
#   full-precision residual window (kv.residual=128), where the cache changes nothing, so the report takes those
#   figures from the kv=fp row and says so (toolkit/report/rows.py checks the residual against the passage).
# - latency: 2 open prompts of 128 tokens, 64 new tokens, 1 repeat after 1 warm-up; no-spec rows interleave
#   transformers generate() (fp32), spec rows the same engine without speculation, and the float model's
#   spec=lookup kv=fp run also transformers' assisted generation with prompt lookup (the peer rows; checkpoints
#   do not repeat it). The report notes each peer it lacks (llama.cpp: llama-cpp-python is not installed here).
#
# Every result line holds its resolved config, protocol, machine facts and git revision; the store is appended to,
# so delete it first for a clean rebuild (the script does unless KEEP_STORE=1). Checkpoints already under
# $CHECKPOINTS are reused (FRESH=1 quantizes into a new folder of its own).
set -euo pipefail
export HF_HUB_OFFLINE=1
OUT=${OUT:-.}
STORE=${STORE:-$OUT/benchmarks/results.jsonl}
CHECKPOINTS=${CHECKPOINTS:-${SPECQUANT_HOME:-$HOME/.cache/specquant}/checkpoints}
[[ ${FRESH:-0} == 1 ]] && CHECKPOINTS=$(mktemp -d "${TMPDIR:-/tmp}/specquant-sweep.XXXXXX")
MODEL=smollm2-135m
if [[ ${QUICK:-0} == 1 ]]; then
  RECIPES=${RECIPES:-"rtn-w4g64"}
  KVS=${KVS:-"fp,int8"}
  SPECS=${SPECS:-"none,lookup"}
  EVAL_FP=(task=all max_windows=4 items=50 gen_prompts=2 gen_new_tokens=16)
  EVAL_KV=(task=ppl max_windows=4)
  BENCH_ARGS=(prompt_tokens=128 new_tokens=32 n_prompts=2 repeats=1)
else
  RECIPES=${RECIPES:-"rtn-w8 rtn-w4g64 gptq-w4g64 awq-w4g64 awq-gptq-w4g64 gptq-w3g64"}
  KVS=${KVS:-"fp,int8,int4"}
  SPECS=${SPECS:-"none,lookup,self"}
  EVAL_FP=(task=all max_windows=8 items=200 gen_prompts=4)
  EVAL_KV=(task=ppl max_windows=8)
  BENCH_ARGS=(prompt_tokens=128 new_tokens=64 n_prompts=2 repeats=1)
fi
QUANT_ARGS=(quantize.n_samples=${CALIBRATION_SAMPLES:-32})
[[ ${KEEP_STORE:-0} == 1 ]] || rm -f "$STORE"
mkdir -p "$(dirname "$STORE")"
start=$SECONDS
stamp() { echo "== sweep: $1 at $((SECONDS - start)) s"; }

models=("$MODEL")
for recipe in $RECIPES; do
  dir=$CHECKPOINTS/$MODEL-$recipe
  [[ -f $dir/quant_manifest.json ]] || specquant quantize "recipe=$MODEL/$recipe" "output=$dir" "${QUANT_ARGS[@]}"
  models+=("$dir")
done
stamp "quantized ${#models[@]} models"
all=$(IFS=,; echo "${models[*]}")
kv_quant=$(echo "$KVS" | tr ',' '\n' | grep -v '^fp$' | paste -sd, -)

specquant eval -m "model=$all" kv=fp "${EVAL_FP[@]}" "store=$STORE" ${EXTRA:-}
stamp "quality, kv=fp"
[[ -z $kv_quant ]] || specquant eval -m "model=$all" "kv=$kv_quant" "${EVAL_KV[@]}" "store=$STORE" ${EXTRA:-}
stamp "quality, kv=$kv_quant"
specquant bench -m "model=$all" "kv=$KVS" "spec=$SPECS" "${BENCH_ARGS[@]}" "+store=$STORE" ${EXTRA:-}
stamp "latency"

shot=()
chromium=${SPECQUANT_HOME:-$HOME/.cache/specquant}/chromium
[[ -d $chromium ]] && shot=("screenshot=$OUT/benchmarks.screenshot.png")
specquant report "store=$STORE" "out=$OUT/BENCHMARKS.md" "png=$OUT/benchmarks.png" "html=$OUT/benchmarks.html" \
  "${shot[@]}"
specquant recommend max_ppl_increase=0.03 "store=$STORE" || true  # nothing within budget is an answer too
stamp "done"
