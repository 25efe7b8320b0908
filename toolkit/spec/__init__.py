"""Speculative decoding: a draft proposes, the target verifies k tokens in one pass, caches roll back what was not
kept. `verify` (pure acceptance rules), `drafts` + `self_draft` (what proposes), `ragged` (a batch whose rows keep
different numbers of tokens over one cache), `decode` (the loop), `build` (a draft from the `spec` config group)."""
