"""Quality evaluation: the maths and item builders behind `specquant eval` and the `evaluate` modules in eval/.

Every figure is computed on the candidate model (as the engine runs it, with its KV cache) and on a reference (the
float source in fp32 with a full-precision cache) over the same windows or items, so differences are the
compression's, never the data's or the protocol's. Modules: `protocol` (what a number means), `metrics` (pure
tensor maths), `windows` (text -> token windows), `forward` (logits through a KV cache), `perplexity` (ppl, KL,
top-1), `items` (cloze and multiple-choice items, cached under a content hash), `cloze`, `choice`, `generation`
(greedy agreement), `suite` (runs tasks and collects figures)."""
