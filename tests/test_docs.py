"""The README and docs/ stay short, linked and true: the README fits on a few screens and carries no lab-notebook
residue (dates, commit hashes), every docs page is reachable from it, every relative link resolves, and every
`specquant ...` command a user may copy composes with hydra (config resolution only, nothing runs), so a renamed
or removed option shows up here, not in a user's terminal."""

import re
import shlex
from pathlib import Path

import pytest

from toolkit.cli import COMMANDS
from toolkit.cli.app import CONF_DIR, translate_argv
from toolkit.report.headline import END, START

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))  # topic pages; docs/notes/ holds dated findings
PAGES = [README, *DOCS]

# Placeholders the docs use where a user puts their own value; replaced by a value of the same kind.
PLACEHOLDERS = {"DIR": "/tmp/ckpt", "HFDIR": "/tmp/hf", "PATH": "/tmp/file", "NAME": "smollm2-135m",
                "FILE": "/tmp/file.txt", "PORT": "8000", "N": "4"}
STOP_TOKENS = {"&&", "||", "|", ";", ">", ">>", "2>&1", "&"}
HYDRA_FLAGS = {"-m", "--multirun"}
NO_COMPOSE_FLAGS = {"--help", "-h", "--hydra-help", "--info", "--cfg", "-c"}


def _code_spans(text: str) -> list[str]:
    """Lines of fenced and indented code blocks, and inline code in tables and prose."""
    spans, fenced = [], False
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("    "):
            while line.rstrip().endswith("\\") and i + 1 < len(lines):  # shell line continuation
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            spans.append(line)
        else:
            spans += [s.replace("\\|", "|") for s in re.findall(r"`([^`]+)`", line)]
        i += 1
    return spans


def _commands(path: Path) -> list[str]:
    out = []
    for span in _code_spans(path.read_text()):
        for match in re.finditer(r"(?<![\w./-])specquant ([a-z]+)\b[^`]*", span):
            if match.group(1) in COMMANDS:
                out.append(match.group(0).strip())
    return out


def _argv(command: str) -> tuple[str, list[str]]:
    words = shlex.split(command, comments=True)
    for i, word in enumerate(words):
        if word in STOP_TOKENS or word.startswith(">"):
            words = words[:i]
            break
    argv = []
    for word in words[2:]:
        key, eq, value = word.partition("=")
        if eq and value in PLACEHOLDERS:
            word = f"{key}={PLACEHOLDERS[value]}"
        elif not eq and word in PLACEHOLDERS:
            word = PLACEHOLDERS[word]
        argv.append(word)
    return words[1], argv


def _sweep_variants(overrides: list[str]) -> list[list[str]]:
    """`-m key=a,b` runs one job per value: one override list per value of each sweep (the others at their
    first value), so every value is composed, a config group's options included."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    choices = []
    for text in overrides:
        override = parser.parse_override(text)
        if override.is_sweep_override():
            prefix = text[:len(text) - len(text.lstrip("+~"))]
            choices.append([f"{prefix}{override.get_key_element()}={v}" for v in override.sweep_string_iterator()])
        else:
            choices.append([text])
    first = [c[0] for c in choices]
    variants = [first]
    for i, options in enumerate(choices):
        variants += [first[:i] + [option] + first[i + 1:] for option in options[1:]]
    return variants


ALL_COMMANDS = sorted({(str(p.relative_to(ROOT)), c) for p in PAGES for c in _commands(p)})


def test_readme_is_short_and_has_no_notebook_residue():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert not re.findall(r"\b\d{4}-\d{2}-\d{2}\b", text), "date stamps belong in docs/notes/"
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", h) and re.search("[a-f]", h)]
    assert not hashes, f"commit hashes belong in docs/notes/: {hashes}"


def test_every_docs_page_is_linked_from_the_readme():
    links = set(re.findall(r"\]\(([^)#\s]+)", README.read_text()))
    missing = [str(p.relative_to(ROOT)) for p in DOCS if str(p.relative_to(ROOT)) not in links]
    assert not missing, f"docs pages the README does not link: {missing}"


NOTES = sorted((ROOT / "docs" / "notes").glob("*.md"))


@pytest.mark.parametrize("page", PAGES + NOTES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        if not (page.parent / target.split("#")[0]).exists():
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files: {broken}"


def test_readme_headline_block_is_generated():
    text = README.read_text()
    assert text.count(START) == 1 and text.count(END) == 1 and text.index(START) < text.index(END)


def test_the_docs_show_commands():
    # guards the extraction below: if it found nothing, the command test would pass vacuously
    assert len(ALL_COMMANDS) >= 20


@pytest.mark.parametrize("page,command", ALL_COMMANDS, ids=[f"{p}: {c}" for p, c in ALL_COMMANDS])
def test_documented_command_composes(page, command):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    name, argv = _argv(command)
    if set(argv) & NO_COMPOSE_FLAGS:
        argv = [a for a in argv if a not in NO_COMPOSE_FLAGS]
    overrides = [a for a in translate_argv(name, argv) if a not in HYDRA_FLAGS]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name=name):
        for variant in _sweep_variants(overrides):
            OmegaConf.to_container(compose(config_name=name, overrides=variant), resolve=True)


def test_an_unknown_option_fails_to_compose():
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    with (initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="bench"),
          pytest.raises(ConfigCompositionException)):
        compose(config_name="bench", overrides=translate_argv("bench", ["no_such_option=1"]))


def test_headline_block_update(tmp_path):
    from toolkit.report.headline import update_readme

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\nold\n{END}\nrest\n")
    assert update_readme(readme, "| new |")
    assert readme.read_text() == f"intro\n{START}\n| new |\n{END}\nrest\n"
    plain = tmp_path / "other.md"
    plain.write_text("no markers\n")
    assert not update_readme(plain, "| new |") and plain.read_text() == "no markers\n"


def test_report_updates_the_readme_beside_benchmarks_md_only(tmp_path):
    from hydra import compose, initialize_config_dir

    from toolkit.cli import report

    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\nold\n{END}\n")
    store = ROOT / "benchmarks" / "results.jsonl"
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR), job_name="report"):
        mine = compose(config_name="report", overrides=[f"store={store}", f"out={tmp_path / 'mine.md'}", "png=null",
                                                        "html=null"])
        bench = compose(config_name="report", overrides=[f"store={store}", f"out={tmp_path / 'BENCHMARKS.md'}",
                                                         "png=null", "html=null"])
    report.run(mine)
    assert "old" in readme.read_text()  # a report of one's own leaves the README alone
    report.run(bench)
    text = readme.read_text()
    assert "old" not in text and "| configuration |" in text and "peer: transformers generate()" in text


def test_code_and_config_comments_carry_no_history():
    """Dated runs belong in docs/notes/, not in code, config or recipe comments."""
    date = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
    files = [p for pattern in ("toolkit/**/*.py", "toolkit/**/*.c", "conf/**/*.yaml", "recipes/**/*.yaml")
             for p in ROOT.glob(pattern)]
    found = [f"{path.relative_to(ROOT)}:{n}" for path in files
             for n, line in enumerate(path.read_text().splitlines(), 1) if date.search(line)]
    assert files and not found, found
