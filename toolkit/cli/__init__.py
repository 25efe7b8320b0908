"""The `specquant` command: one hydra app per subcommand, all over the config tree in conf/.

    specquant COMMAND [key=value ...] [-m key=a,b ...] [--help]

Positional words are translated into overrides before hydra sees them, so the commands read naturally:
`specquant models fetch gemma3-270m` -> `action=fetch model=gemma3-270m`. A `model=` or `data=` value that is not
an option of its config group (a directory, a hub id, a file) becomes `model.name=...` / `data.name=...`.
"""

import os
import sys

COMMANDS = {
    "generate": "continue a prompt (streamed), with TTFT and inter-token latencies",
    "bench": "prefill and decode latency against transformers generate(), interleaved; JSON out",
    "quantize": "quantize Linear weights (RTN, GPTQ, AWQ) and write a checkpoint for model=DIR",
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


def _with_huge_pages(argv: list[str]) -> None:
    """Re-run this process with glibc's malloc backing large blocks by transparent huge pages (``quantize`` only).

    Calibration forwards allocate activations of hundreds of MB per op; glibc serves each from fresh mmap'd
    memory, and every 4 KiB page of it faults (21.7 M faults, 54 s of kernel time in a 160 s GPTQ run on
    SmolLM2). ``glibc.malloc.hugetlb=1`` makes those 2 MiB pages where the kernel's THP mode is ``madvise``
    (0.5 M faults; that run took 147 s). glibc reads tunables only at start-up, hence the re-exec. A
    ``GLIBC_TUNABLES`` of the user's own, ``SPECQUANT_NO_REEXEC=1``, or a libc other than glibc: left alone.
    """
    import platform

    if (sys.platform != "linux" or "GLIBC_TUNABLES" in os.environ or os.environ.get("SPECQUANT_NO_REEXEC")
            or platform.libc_ver()[0] != "glibc"):
        return
    os.environ["GLIBC_TUNABLES"] = "glibc.malloc.hugetlb=1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "toolkit", *argv])


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] == ["quantize"]:
        _with_huge_pages(sys.argv[1:])
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
