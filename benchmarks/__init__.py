"""Experiment scripts no `specquant` command runs (KV caches, paged KV, serving load, kernels, quality, forwards,
prefill, row costs, lookup replays, AWQ screens, other tools' quantizers), and the results store behind
BENCHMARKS.md. Outside the installed package, so a script may import any layer of it; run one from the repository
root: `python -m benchmarks.NAME --help`."""
