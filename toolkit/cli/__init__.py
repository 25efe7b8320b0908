"""The `specquant` command: one hydra app per subcommand, all over the config tree in conf/.

    specquant COMMAND [key=value ...] [-m key=a,b ...] [--help]

Positional words are translated into overrides before hydra sees them, so the commands read naturally:
`specquant models fetch gemma3-270m` -> `action=fetch model=gemma3-270m`. A `model=` or `data=` value that is not
an option of its config group (a directory, a hub id, a file) becomes `model.name=...` / `data.name=...`.
"""

import sys

COMMANDS = {
    "generate": "continue a prompt (streamed), with TTFT and inter-token latencies",
    "bench": "prefill and decode latency against transformers generate(), interleaved; JSON out",
    "quantize": "quantize Linear weights (RTN, GPTQ; AWQ to come) and write a checkpoint for model=DIR",
    "export": "write a quantized checkpoint in the GPTQ (v1) or AWQ (GEMM) format other tools load",
    "eval": "quality against the reference model: perplexity, KL, top-1, cloze, multiple choice, generation",
    "report": "results store -> Markdown table (BENCHMARKS.md), quality-vs-latency Pareto PNG, HTML page",
    "recommend": "the fastest configuration in the results store within a quality budget, and why",
    "models": "list | fetch | verify offline models and the local cache",
    "data": "list | fetch | show offline text datasets and their splits",
    "demo": "fetch the default model, generate, benchmark, and print what was measured",
    "serve": "an OpenAI-compatible HTTP server with streaming and continuous batching",
    "diagnose": "the latency doctor: TTFT vs ITL, compute or memory bound, KV pressure, measured what-ifs",
}

USAGE = """usage: specquant COMMAND [key=value ...] [-m key=a,b ...] [--help]

Compress LLMs and make them generate fast. Commands:
{commands}

Every command is a hydra app over conf/: `specquant COMMAND --help` lists its config groups and options.
"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        width = max(map(len, COMMANDS))
        print(USAGE.format(commands="\n".join(f"  {c:<{width}}  {d}" for c, d in COMMANDS.items())))
        return
    if argv[0] in ("-V", "--version"):
        from toolkit import __version__

        print(f"specquant {__version__}")
        return
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        import difflib

        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        print(f"specquant: unknown command {command!r}{hint}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    from toolkit.cli.app import run_command

    run_command(command, rest)
