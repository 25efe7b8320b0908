"""specquant generate: continue one prompt (streamed) or a batch from a prompt set, with timing."""

import sys

from omegaconf import OmegaConf
from rich.console import Console

from toolkit.data import build_prompts
from toolkit.engine.generate import generate
from toolkit.engine.sampling import SamplingParams
from toolkit.engine.setup import load_engine_model
from toolkit.engine.spec import EngineSpec
from toolkit.errors import InputError
from toolkit.kv import KVSpec
from toolkit.results import write_result
from toolkit.spec.build import build_draft, draft_length
from toolkit.spec.config import SpecConfig
from toolkit.spec.decode import speculative_generate
from toolkit.timing import process_peak_rss_mb

console = Console(stderr=True, width=None if sys.stderr.isatty() else 150)


def prompt_texts(cfg, tokenizer) -> list[str]:
    if cfg.prompts:

        return [p.text for p in build_prompts(cfg.prompts, tokenizer, cfg.prompt_tokens, cfg.n_prompts)]
    if cfg.prompt is None or not str(cfg.prompt).strip():
        raise InputError("the prompt is empty", 'give one: specquant generate prompt="Once upon a time"')
    return [str(cfg.prompt)]


def apply_chat_template(tokenizer, text: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("chat=true but this tokenizer has no chat template", "use chat=false (plain continuation)")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def run(cfg) -> dict:
    engine, kv = EngineSpec.from_node(cfg.engine), KVSpec.from_node(cfg.kv)  # resolved once, here
    loaded = load_engine_model(cfg.model.name, engine)
    texts = prompt_texts(cfg, loaded.tokenizer)
    if cfg.chat:
        texts = [apply_chat_template(loaded.tokenizer, t) for t in texts]
    sampling = SamplingParams(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    streaming = cfg.stream and len(texts) == 1

    def on_token(row, token, delta):
        sys.stdout.write(delta)
        sys.stdout.flush()

    if streaming:
        sys.stdout.write(texts[0] if not cfg.chat else "")
    spec = SpecConfig.of(cfg.get("spec"))  # resolved once, here
    if spec.kind != "none":  # speculative decoding (toolkit/spec): same outputs, fewer passes

        draft = build_draft(spec, loaded.model, loaded.tokenizer, sampling, engine)
        result = speculative_generate(loaded.model, loaded.tokenizer, texts, cfg.new_tokens, draft, draft_length(spec),
                                      sampling, stop_strings=list(cfg.stop),
                                      on_token=on_token if streaming else None, kv=kv)
    else:
        result = generate(loaded.model, loaded.tokenizer, texts, cfg.new_tokens, sampling,
                          stop_strings=list(cfg.stop), on_token=on_token if streaming else None, kv=kv)
    if streaming:
        sys.stdout.write("\n")
    else:
        for i, seq in enumerate(result.sequences):
            print(f"--- [{i}] {seq.finish_reason}, {len(seq.token_ids)} tokens\n{texts[i]}[+]{seq.text}")
    summary = {**result.timing.summary(), "peak_rss_mb": process_peak_rss_mb()}
    console.print(f"[dim]{loaded.name} {loaded.precision.name} | prompt {summary['prompt_tokens']} tok x "
                  f"{summary['batch_size']} | new {summary['new_tokens']} tok | TTFT {summary['ttft_ms']:.0f} ms | "
                  f"ITL p50 {summary['itl_ms']['p50']:.1f} ms | decode {summary['decode_tokens_per_s']:.1f} tok/s | "
                  f"peak RSS {summary['peak_rss_mb']:.0f} MB[/]",
                  highlight=False)
    if getattr(result, "stats", None) is not None:
        stats = result.stats.summary()
        summary["spec"] = stats
        console.print(f"[dim]spec={spec.kind}: acceptance {stats['acceptance_rate']:.2f} | "
                      f"mean accepted {stats['mean_accepted']:.2f} per round | {stats['rounds']} target passes | "
                      f"draft {stats['draft_s'] * 1e3:.0f} ms, verify {stats['verify_s'] * 1e3:.0f} ms | "
                      f"{stats['tokens_per_s']:.1f} tok/s end to end[/]", highlight=False)
    record = {"model": loaded.name, "dtype": loaded.precision.name, "timing": summary,
              "outputs": [{"prompt": t, "text": s.text, "token_ids": s.token_ids, "finish_reason": s.finish_reason}
                          for t, s in zip(texts, result.sequences)],
              "config": OmegaConf.to_container(cfg, resolve=True)}
    if cfg.out:
        write_result(cfg.out, record)
    return record
