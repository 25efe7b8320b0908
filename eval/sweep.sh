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
#   do not repeat it). Where llama-cpp-python imports, the no-spec kv=fp runs also interleave llama.cpp
#   (baseline='hf,llamacpp': the model's GGUF requantized to F16 / Q8_0 / Q4_0, the type nearest the weights), a
#   llama.cpp row beside each; the quantized-cache runs do not repeat it (llama.cpp keeps its own f16 cache). The
#   report notes each peer it lacks.
# - int8 activations: each int4 and int8 checkpoint also at engine.native_dot=int8 (the w4a8 / w8a8 kernels,
#   llama.cpp's q8 activations; int8 weights need AVX512-VNNI, elsewhere the sweep says so and goes on), kv=fp: perplexity, KL and top-1 on the kv=fp windows (the only task it is evaluated on) and a
#   no-spec bench with the same baselines; rows of their own ("..., engine.native_dot=int8").
# - beside llama.cpp, medians (where llama-cpp-python imports; LLAMACPP=0 skips it): the float model at
#   engine.native_dot=fp32 and bf16, each int4/int8 checkpoint at fp32 and int8, after 128- and 512-token open
#   prompts (64 new tokens); speculation (lookup on grounded prompts, self-draft on open ones for the float model,
#   lookup for each int4/int8 checkpoint at its fastest precision) against llama.cpp's plain decode; one 4,000-token
#   prompt (32 new tokens) for the float model and each checkpoint at int8 activations, with each KV cache beside
#   llama.cpp's of the same bits (kv=fp / int8 / int4: its f16 / q8_0 / q4_0); 3 prompts (1 at 4,000) x 3
#   repeats each, a ratio per repeat, the median in BENCHMARKS.md's "Beside llama.cpp" table and the README
#   (toolkit/report/llamacpp.py). Tagged +bench=llamacpp, so they stay out of the main table's rows.
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
  EVAL_INT8=(task=ppl max_windows=4)
  BENCH_ARGS=(prompt_tokens=128 new_tokens=32 n_prompts=2 repeats=1)
else
  # NAME (a shipped recipe) or NAME=RECIPE,OVERRIDE,... (a variant, docs/quantization.md "Variants as overrides")
  RECIPES=${RECIPES:-"rtn-w8 rtn-w4g64 gptq-w4g64 awq-w4g64 awq-gptq-w4g64=awq-w4g64,quantize.awq_clip=false,quantize.awq_rounding=gptq,quantize.act_order=true,quantize.mse=true gptq-w3g64=gptq-w4g64,quantize.bits=3"}
  KVS=${KVS:-"fp,int8,int4"}
  SPECS=${SPECS:-"none,lookup,self"}
  EVAL_FP=(task=all max_windows=8 items=200 gen_prompts=4)
  EVAL_KV=(task=ppl max_windows=8)
  EVAL_INT8=(task=ppl max_windows=8)
  BENCH_ARGS=(prompt_tokens=128 new_tokens=64 n_prompts=2 repeats=1)
fi
QUANT_ARGS=(quantize.n_samples=${CALIBRATION_SAMPLES:-32})
[[ ${KEEP_STORE:-0} == 1 ]] || rm -f "$STORE"
mkdir -p "$(dirname "$STORE")"
start=$SECONDS
stamp() { echo "== sweep: $1 at $((SECONDS - start)) s"; }
without() { echo "$1" | tr ',' '\n' | grep -vx "$2" | paste -sd, - || true; }  # a comma list less one item
has() { [[ ,$1, == *,$2,* ]]; }

# llama.cpp beside the engine where llama-cpp-python imports (an optional source build); quoted, so hydra reads
# one value rather than a sweep over two
if python -c "import llama_cpp" 2>/dev/null; then
  PEERS="baseline='hf,llamacpp'"
else
  PEERS="baseline=hf"
  echo "== sweep: llama-cpp-python is not installed (pip install -e \".[llamacpp]\"): no llama.cpp rows (noted)"
fi

models=("$MODEL")
int8act=()  # checkpoints with 4- or 8-bit weights: also measured with int8 activations (engine.native_dot=int8)
for entry in $RECIPES; do
  recipe=${entry%%=*}
  IFS=, read -ra args <<< "${entry#*=}"  # NAME: (NAME); NAME=RECIPE,OVERRIDE,...: (RECIPE OVERRIDE ...)
  dir=$CHECKPOINTS/$MODEL-$recipe
  [[ -f $dir/quant_manifest.json ]] || specquant quantize "recipe=$MODEL/${args[0]}" "${args[@]:1}" "output=$dir" \
    "${QUANT_ARGS[@]}"
  models+=("$dir")
  bits=$(python -c 'import json, sys; print(json.load(open(sys.argv[1]))["recipe"]["bits"])' "$dir/quant_manifest.json")
  if [[ $bits == 4 || $bits == 8 ]]; then int8act+=("$dir"); fi
done
stamp "quantized ${#models[@]} models (${#int8act[@]} int4/int8)"
all=$(IFS=,; echo "${models[*]}")
kv_quant=$(without "$KVS" fp)
spec_on=$(without "$SPECS" none)

specquant eval -m "model=$all" kv=fp "${EVAL_FP[@]}" "store=$STORE" ${EXTRA:-}
stamp "quality, kv=fp"
[[ -z $kv_quant ]] || specquant eval -m "model=$all" "kv=$kv_quant" "${EVAL_KV[@]}" "store=$STORE" ${EXTRA:-}
stamp "quality, kv=$kv_quant"
# int8 activations: one checkpoint at a time, so one the kernels cannot run (it says why) leaves the rest
for dir in "${int8act[@]}"; do
  specquant eval "model=$dir" kv=fp engine.native_dot=int8 "${EVAL_INT8[@]}" "store=$STORE" ${EXTRA:-} \
    || echo "== sweep: no engine.native_dot=int8 quality for $dir (see above)"
done
stamp "quality, engine.native_dot=int8"

if has "$SPECS" none; then
  if has "$KVS" fp; then
    specquant bench -m "model=$all" kv=fp spec=none "$PEERS" "${BENCH_ARGS[@]}" "+store=$STORE" ${EXTRA:-}
  fi
  [[ -z $kv_quant ]] || specquant bench -m "model=$all" "kv=$kv_quant" spec=none "${BENCH_ARGS[@]}" "+store=$STORE" \
    ${EXTRA:-}
  for dir in "${int8act[@]}"; do
    specquant bench "model=$dir" kv=fp spec=none engine.native_dot=int8 "$PEERS" "${BENCH_ARGS[@]}" "+store=$STORE" \
      ${EXTRA:-} || echo "== sweep: no engine.native_dot=int8 latency for $dir (see above)"
  done
fi
[[ -z $spec_on ]] || specquant bench -m "model=$all" "kv=$KVS" "spec=$spec_on" "${BENCH_ARGS[@]}" "+store=$STORE" \
  ${EXTRA:-}
stamp "latency"

if [[ $PEERS == *llamacpp* && ${LLAMACPP:-1} == 1 ]]; then
  SIDE=(baseline=llamacpp "repeats=${SIDE_REPEATS:-3}" warmup=1 +bench=llamacpp "+store=$STORE")
  specquant bench -m "model=$MODEL" engine.native_dot=fp32,bf16 kv=fp spec=none prompts=open prompt_tokens=128,512 \
    new_tokens=64 n_prompts=3 "${SIDE[@]}" ${EXTRA:-} || echo "== sweep: a float llama.cpp side-by-side failed (see above)"
  specquant bench "model=$MODEL" kv=fp spec=lookup prompts=grounded prompt_tokens=256 new_tokens=128 n_prompts=3 "${SIDE[@]}" \
    ${EXTRA:-}
  specquant bench "model=$MODEL" kv=fp spec=self prompts=open prompt_tokens=128 new_tokens=128 n_prompts=3 "${SIDE[@]}" ${EXTRA:-}
  # long context: one 4,000-token prompt (kv=fp: fp16 on an AVX512 CPU, as llama.cpp's f16 cache; kv=int8 / int4
  # beside llama.cpp's q8_0 / q4_0 cache)
  specquant bench -m "model=$MODEL" kv=fp,int8,int4 spec=none prompts=open prompt_tokens=4000 new_tokens=32 n_prompts=1 \
    "${SIDE[@]}" ${EXTRA:-}
  for dir in "${int8act[@]}"; do
    specquant bench -m "model=$dir" engine.native_dot=fp32,int8 kv=fp spec=none prompts=open prompt_tokens=128,512 \
      new_tokens=64 n_prompts=3 "${SIDE[@]}" ${EXTRA:-} || echo "== sweep: a llama.cpp side-by-side of $dir failed (see above)"
    specquant bench -m "model=$dir" engine.native_dot=int8 kv=fp,int8,int4 spec=none prompts=open prompt_tokens=4000 \
      new_tokens=32 n_prompts=1 "${SIDE[@]}" ${EXTRA:-} || echo "== sweep: no 4,000-token run of $dir (see above)"
    specquant bench "model=$dir" engine.native_dot=int8 kv=fp spec=lookup prompts=grounded prompt_tokens=256 \
      new_tokens=128 n_prompts=3 "${SIDE[@]}" ${EXTRA:-} || specquant bench "model=$dir" kv=fp spec=lookup prompts=grounded \
      prompt_tokens=256 new_tokens=128 n_prompts=3 "${SIDE[@]}" ${EXTRA:-}
  done
  stamp "beside llama.cpp"
fi

shot=()
chromium=${SPECQUANT_HOME:-$HOME/.cache/specquant}/chromium
[[ -d $chromium ]] && shot=("screenshot=$OUT/benchmarks.screenshot.png")
specquant report "store=$STORE" "out=$OUT/BENCHMARKS.md" "png=$OUT/benchmarks.png" "html=$OUT/benchmarks.html" \
  "${shot[@]}"
specquant recommend max_ppl_increase=0.03 "store=$STORE" || true  # nothing within budget is an answer too
stamp "done"
