"""specquant: compress LLMs (quantized weights and KV caches) and make them generate fast (speculative decoding).

The import package is `toolkit`; the distribution and console script are `specquant`.
Data flows one way: recipe -> quantize -> checkpoint -> load -> engine -> eval/bench/serve.
"""

__version__ = "0.1.0"
