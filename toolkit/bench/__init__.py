"""Latency benchmarks: the engine against peers on the same model, prompts and threads, interleaved in one run."""
