"""Section 1, the input: what the user's prompts cost in tokens, and how much of them a prefix cache could skip."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def repeated_prefix_tokens(encoded: list[list[int]]) -> list[int]:
    """Per prompt, the tokens at its start that an earlier prompt already began with: what a prefix cache filled by
    the earlier prompts would not have to prefill again (the first prompt repeats nothing)."""
    out = []
    for i, ids in enumerate(encoded):
        out.append(max((common_prefix(ids, earlier) for earlier in encoded[:i]), default=0))
    return out


def input_stats(texts: list[str], encoded: list[list[int]]) -> dict:
    """Characters, tokens, tokens per character (the tokenizer's efficiency on this text) and the repeated-prefix
    share (tokens a prefix cache would skip / all prompt tokens)."""
    chars = sum(len(t) for t in texts)
    tokens = sum(len(ids) for ids in encoded)
    repeated = repeated_prefix_tokens(encoded)
    return {
        "prompts": len(texts),
        "chars": chars,
        "tokens": tokens,
        "tokens_per_prompt": tokens / len(encoded),
        "tokens_per_char": tokens / chars if chars else float("nan"),
        "chars_per_token": chars / tokens if tokens else float("nan"),
        "repeated_prefix_tokens": sum(repeated),
        "repeated_prefix_share": sum(repeated) / tokens if tokens else 0.0,
    }
