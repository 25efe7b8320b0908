"""The text layer: offline datasets with disjoint splits, local files, errors, and benchmark prompt sets.

Runs offline (HF_HUB_OFFLINE=1). Tests marked needs_debian fetch Debian packages with apt-get and are
skipped, with the reason, where the Debian registry cannot be reached.
"""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from toolkit.data import (
    CALIBRATION,
    DATASETS,
    EVALUATION,
    PROMPT_SETS,
    build_prompts,
    cache,
    debian,
    fetch,
    is_cached,
    list_datasets,
    load_splits,
    load_text,
    sources,
)
from toolkit.data.prompts import _GROUNDED_TASKS, _tolerance, count_tokens
from toolkit.errors import DataError, InputError

needs_debian = pytest.mark.needs_debian


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """Hub off, and a fresh empty specquant home so no test sees another's cache."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    """conftest's byte-level BPE trained on pydoc: realistic (words split into several tokens, exact round
    trips) and built without the hub."""
    return tiny_tokenizer


class WordTokenizer:
    """The least a tokenizer needs to offer: encode(text) -> ids, no keywords."""

    def encode(self, text):
        return [hash(t) for t in re.findall(r"\w+|[^\w\s]", text)]

    def decode(self, ids):
        raise NotImplementedError


def titles(ds):
    return set(ds["title"])


# ---------------------------------------------------------------------------------------------------
# Built-in sources


@pytest.mark.parametrize("name", ["pydoc", "stdlib-code"])
def test_builtin_splits_are_disjoint_nonempty_and_deterministic(name):
    splits = load_splits(name)
    calibration, evaluation = splits[CALIBRATION], splits[EVALUATION]
    assert set(splits) == {CALIBRATION, EVALUATION}
    assert calibration.column_names == evaluation.column_names == ["title", "text"]
    assert len(calibration) and len(evaluation)
    assert not titles(calibration) & titles(evaluation)
    assert not set(calibration["text"]) & set(evaluation["text"])
    assert 0.05 < len(evaluation) / (len(calibration) + len(evaluation)) < 0.4  # about 80/20
    again = load_splits(name)
    assert again[EVALUATION]["title"] == evaluation["title"] and again[CALIBRATION]["text"] == calibration["text"]


def test_pydoc_is_the_topic_help_without_repeats():
    from pydoc_data.topics import topics

    splits = load_splits("pydoc")
    kept = titles(splits[CALIBRATION]) | titles(splits[EVALUATION])
    assert kept < set(topics) and {"compound", "formatstrings"} <= kept
    assert "try" not in kept  # the "try" topic is a section of the "compound" topic
    corpus = "".join(text for ds in splits.values() for text in ds["text"])
    assert topics["try"].split("\n\n")[3] in corpus


@pytest.mark.parametrize("name", ["pydoc", "stdlib-code"])
def test_no_long_block_of_text_is_in_both_splits(name):
    splits = load_splits(name)
    blocks = {split: {b for text in ds["text"] for b in sources.paragraphs(text) if len(b) >= 100}
              for split, ds in splits.items()}
    assert not blocks[CALIBRATION] & blocks[EVALUATION]


def test_documents_sharing_text_stay_in_one_split():
    shared = "A paragraph long enough to count as shared text between two documents, " * 2
    docs = [sources.Document("a", f"intro a\n\n{shared}", "k1"), sources.Document("b", f"{shared}\n\nmore b", "k2"),
            sources.Document("c", "unrelated", "k3")]
    split = {"k1": CALIBRATION, "k2": EVALUATION, "k3": EVALUATION}.get
    assert sources.assign_splits(docs, split) == [CALIBRATION, CALIBRATION, EVALUATION]  # a tie goes to calibration


def test_stdlib_code_leaves_out_tests_and_third_party_code():
    paths = titles(load_splits("stdlib-code")[CALIBRATION]) | titles(load_splits("stdlib-code")[EVALUATION])
    assert "os.py" in paths and "json/decoder.py" in paths
    assert not [p for p in paths if re.search(r"(^|/)(tests?|idle_test|site-packages|pydoc_data)/", p)]


def test_hash_split_is_stable_and_about_one_in_five():
    keys = [f"key-{i}" for i in range(2000)]
    splits = [sources.hash_split(k) for k in keys]
    assert splits == [sources.hash_split(k) for k in keys]
    assert 0.15 < splits.count(EVALUATION) / len(keys) < 0.25
    assert sources.hash_split("assert") == sources.hash_split("assert")


def test_list_datasets_describes_every_dataset():
    rows = {row["name"]: row for row in list_datasets()}
    assert set(rows) == set(DATASETS)
    assert rows["pydoc"]["cached"] and rows["pydoc"]["documents"][EVALUATION] > 0 and rows["pydoc"]["size"] > 300_000
    assert rows["austen"]["needs_fetch"] and not rows["austen"]["cached"] and rows["austen"]["documents"] is None


# ---------------------------------------------------------------------------------------------------
# Local files


def test_txt_file_is_one_document_or_paragraph_chunks(tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("One paragraph.\n\nAnother one.\n")
    assert load_text(short)["text"] == ["One paragraph.\n\nAnother one."]

    paragraphs = [f"Paragraph {i}. " + "word " * 100 for i in range(40)]
    long = tmp_path / "long.txt"
    long.write_text("\n\n".join(paragraphs))
    chunks = load_text(long)["text"]
    assert len(chunks) > 1 and all(len(c) <= sources.TXT_CHUNK_CHARS for c in chunks)
    assert "\n\n".join(chunks) == "\n\n".join(p.strip() for p in paragraphs)


def test_jsonl_and_parquet_files_load(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"text": "first", "title": "A"}\n\n{"text": "second"}\n')
    ds = load_text(jsonl)
    assert ds["text"] == ["first", "second"] and ds["title"] == ["A", "docs.jsonl:3"]

    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": ["alpha", "beta"], "extra": [1, 2]}), parquet)
    assert load_text(parquet)["text"] == ["alpha", "beta"]


def test_a_local_file_is_used_whole_whichever_split(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("Some text.")
    assert list(load_splits(path)) == [sources.ALL]
    assert load_text(path, split=CALIBRATION)["text"] == load_text(path, split=EVALUATION)["text"] == ["Some text."]


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.txt", "no such file"),
    (lambda d: d, "is a directory"),
    (lambda d: (d / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n') and d / "bad.jsonl", "line 2 is not valid JSON"),
    (lambda d: (d / "list.jsonl").write_text('["text"]\n') and d / "list.jsonl", "line 1 is not a JSON object"),
    (lambda d: (d / "notext.jsonl").write_text('{"body": "x"}\n') and d / "notext.jsonl", 'no string field "text"'),
    (lambda d: (d / "empty.txt").write_text("\n\n") and d / "empty.txt", "holds no text"),
    (lambda d: (d / "latin1.txt").write_bytes(b"caf\xe9") and d / "latin1.txt", "not UTF-8"),
    (lambda d: (d / "junk.parquet").write_bytes(b"not parquet") and d / "junk.parquet", "not a readable parquet"),
    (lambda d: (d / "table.csv").write_text("text\nx\n") and d / "table.csv", "unsupported file type .csv"),
])
def test_unreadable_files_raise_data_error(tmp_path, make, message):
    with pytest.raises(DataError, match=re.escape(message)) as error:
        load_text(make(tmp_path))
    assert error.value.fix


def test_parquet_without_text_column_names_its_columns(tmp_path):
    path = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"body": ["x"]}), path)
    with pytest.raises(DataError, match=r'no column "text" \(it has body\)'):
        load_text(path)


# ---------------------------------------------------------------------------------------------------
# Names that are not there


def test_unknown_dataset_suggests_close_names():
    with pytest.raises(DataError, match="unknown dataset 'pydco'") as error:
        load_text("pydco")
    assert "did you mean pydoc" in error.value.fix
    with pytest.raises(DataError, match="unknown dataset"):
        fetch("austin")


def test_hub_dataset_offline_says_how_to_get_it():
    with pytest.raises(DataError, match="HF_HUB_OFFLINE") as error:
        load_text("someorg/somedata")
    assert "pydoc" in error.value.fix


def test_hub_dataset_online_maps_train_and_validation(monkeypatch):
    import datasets

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    hub = datasets.DatasetDict({split: datasets.Dataset.from_dict({"text": texts}) for split, texts in
                                {"train": ["a", "", "b"], "validation": ["v"], "test": ["t"]}.items()})
    asked = []
    monkeypatch.setattr(datasets, "load_dataset", lambda repo, config=None: asked.append((repo, config)) or hub)
    splits = load_splits("org/name:cfg")
    assert asked == [("org/name", "cfg")]
    assert {split: list(ds["text"]) for split, ds in splits.items()} == {
        CALIBRATION: ["a", "b"], EVALUATION: ["v"], "other": ["t"]}
    assert splits[EVALUATION]["title"] == ["org/name:cfg/validation/0"]


def test_unknown_split_lists_the_splits():
    with pytest.raises(DataError, match="no split 'train'") as error:
        load_text("pydoc", split="train")
    assert "calibration, evaluation" in error.value.fix


def test_debian_dataset_not_fetched_says_how_to_fetch():
    assert not is_cached("austen")
    with pytest.raises(DataError, match="austen is not fetched") as error:
        load_text("austen")
    assert "specquant data fetch austen" in error.value.fix and "Debian" in error.value.fix


def test_fetch_without_apt_get_names_the_debian_registry(monkeypatch):
    monkeypatch.setattr(debian.shutil, "which", lambda name: None)
    with pytest.raises(DataError, match="apt-get") as error:
        fetch("austen", progress=False)
    assert "Debian package registry" in error.value.fix


def test_fetch_of_builtin_source_is_a_no_op():
    assert fetch("pydoc") is None and is_cached("pydoc") and is_cached("stdlib-code")


def test_corrupt_cache_is_detected_and_re_fetch_suggested():
    docs = [sources.Document("Persuasion, chapter 1", "Sir Walter Elliot.", "Persuasion")]
    folder = cache.write_cache("austen", docs, "test")
    assert load_text("austen")["text"] == ["Sir Walter Elliot."]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["documents"] == 1 and len(manifest["sha256"]) == 64

    (folder / "documents.parquet").write_bytes(b"garbage")
    with pytest.raises(DataError, match="corrupt") as error:
        load_text("austen")
    assert "specquant data fetch austen" in error.value.fix
    row = next(r for r in list_datasets() if r["name"] == "austen")
    assert not row["cached"] and "corrupt" in row["problem"]


# ---------------------------------------------------------------------------------------------------
# Prompt sets


def assert_sized(tokenizer, prompts, budget):
    for prompt in prompts:
        assert budget - 2 * _tolerance(budget) <= count_tokens(tokenizer, prompt.text) <= budget, prompt


def in_any(text, docs):
    return any(text in doc for doc in docs)


@pytest.mark.parametrize("name", ["open", "grounded", "code"])
@pytest.mark.parametrize("budget", [24, 200])
def test_prompt_sets_are_deterministic_and_sized(tokenizer, name, budget):
    if name == "grounded":
        budget = max(budget, 128)  # the instruction alone takes tens of tokens
    prompts = build_prompts(name, tokenizer, budget, 12, seed=0)
    assert len(prompts) == 12 and len({p.id for p in prompts}) == 12 and {p.kind for p in prompts} == {name}
    assert_sized(tokenizer, prompts, budget)
    assert build_prompts(name, tokenizer, budget, 12, seed=0) == prompts
    assert build_prompts(name, tokenizer, budget, 5, seed=0) == prompts[:5]  # a larger n extends a smaller one
    assert [p.text for p in build_prompts(name, tokenizer, budget, 12, seed=1)] != [p.text for p in prompts]


def test_open_prompts_come_from_evaluation_text_only(tokenizer):
    splits = load_splits("pydoc")
    for prompt in build_prompts("open", tokenizer, 64, 20):
        assert in_any(prompt.text, splits[EVALUATION]["text"]) and not in_any(prompt.text, splits[CALIBRATION]["text"])
        assert prompt.text[0].isupper() or prompt.text[0] in "\"“‘"  # begins a paragraph
        assert not prompt.text[-1].isspace()


def test_grounded_prompts_rotate_instructions_around_an_evaluation_passage(tokenizer):
    evaluation = load_text("pydoc")["text"]
    prompts = build_prompts("grounded", tokenizer, 128, 6)
    for prompt, task in zip(prompts, _GROUNDED_TASKS * 2):
        head, tail = task.split("{passage}")
        assert prompt.text.startswith(head) and prompt.text.endswith(tail)
        assert in_any(prompt.text[len(head):-len(tail)], evaluation)


def test_code_prompts_start_at_a_definition_in_evaluation_files(tokenizer):
    splits = load_splits("stdlib-code")
    for prompt in build_prompts("code", tokenizer, 96, 10):
        assert re.match(r"(@|(async\s+)?def\s|class\s)", prompt.text)
        assert in_any(prompt.text, splits[EVALUATION]["text"]) and not in_any(prompt.text, splits[CALIBRATION]["text"])


def test_prompts_work_with_a_minimal_tokenizer():
    words = WordTokenizer()
    prompts = build_prompts("open", words, 50, 4)
    assert_sized(words, prompts, 50)


def test_prompt_file_txt_and_jsonl(tmp_path, tokenizer):
    txt = tmp_path / "p.txt"
    txt.write_text("First prompt\nstill first.\n\nSecond prompt.\n\n\nThird.\n")
    assert [p.text for p in build_prompts(txt, tokenizer, 100, 2)] == ["First prompt\nstill first.", "Second prompt."]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "Hello"}\n{"text": "World"}\n')
    prompts = build_prompts(str(jsonl), tokenizer, 100, 10)
    assert [(p.text, p.kind) for p in prompts] == [("Hello", "file"), ("World", "file")]


def test_prompt_file_errors(tmp_path, tokenizer):
    with pytest.raises(DataError, match="no such file"):
        build_prompts(tmp_path / "none.txt", tokenizer, 10, 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    with pytest.raises(DataError, match='line 1 has no string field "prompt"'):
        build_prompts(bad, tokenizer, 10, 1)


def test_prompt_argument_errors(tokenizer):
    with pytest.raises(DataError, match="unknown prompt set 'opne'") as error:
        build_prompts("opne", tokenizer, 32, 1)
    assert all(name in error.value.fix for name in PROMPT_SETS)
    for bad in ({"prompt_tokens": 0, "n": 1}, {"prompt_tokens": 32, "n": 0}, {"prompt_tokens": 32, "n": True}):
        with pytest.raises(InputError, match="must be a positive whole number"):
            build_prompts("open", tokenizer, **bad)
    with pytest.raises(InputError, match="instruction alone takes"):
        build_prompts("grounded", tokenizer, 8, 1)


def test_too_many_prompts_for_the_text_is_a_clear_error(tokenizer):
    with pytest.raises(DataError, match="prompts of 100000 tokens fit"):
        build_prompts("open", tokenizer, 100_000, 1)


# ---------------------------------------------------------------------------------------------------
# Debian-packaged datasets, fetched for real once per module (into a private home)


@pytest.fixture(scope="module")
def debian_home(tmp_path_factory):
    return tmp_path_factory.mktemp("debian-home"), {}


@pytest.fixture
def fetched(debian_home, monkeypatch):
    """need(name): use the module's fetched copy of `name`, fetching it on first use; skip if Debian is out of reach."""
    home, problems = debian_home
    monkeypatch.setenv("SPECQUANT_HOME", str(home))

    def need(name):
        if name not in problems:
            try:
                fetch(name, progress=False)
                problems[name] = None
            except DataError as e:
                problems[name] = e.problem
        if problems[name]:
            pytest.skip(f"cannot fetch {name} from the Debian registry: {problems[name]}")
        return home / "data" / name

    return need


@needs_debian
def test_austen_splits_by_novel(fetched):
    fetched("austen")
    splits = load_splits("austen")
    novels = {split: {t.split(", chapter")[0] for t in ds["title"]} for split, ds in splits.items()}
    assert novels[CALIBRATION] == {"Sense & Sensibility", "Emma"}
    assert novels[EVALUATION] == {"Persuasion"}
    assert novels["other"] == {"Pride & Prejudice", "Mansfield Park", "Northanger Abbey"}
    assert len(splits[CALIBRATION]) == 50 + 55 and len(splits[EVALUATION]) == 24
    assert splits[EVALUATION]["text"][0].startswith("Sir Walter Elliot, of Kellynch Hall")
    heading = re.compile(r"(?im)^\s*(chapter \w+|volume \w+|finis|the end)\s*$")
    assert not any(heading.search(text) for text in splits[EVALUATION]["text"])


@needs_debian
def test_fetched_data_loads_offline_and_fetch_is_then_a_no_op(fetched, monkeypatch):
    fetched("austen")
    def no_network(*args, **kwargs):
        raise AssertionError("should not run apt-get")
    monkeypatch.setattr(debian, "_run", no_network)
    assert is_cached("austen") and fetch("austen", progress=False) == fetched("austen")
    assert len(load_text("austen")) == 24


@needs_debian
def test_corrupt_fetched_cache_is_fetched_again(fetched):
    folder = fetched("austen")
    data = folder / "documents.parquet"
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(DataError, match="corrupt"):
        load_text("austen")
    fetch("austen", progress=False)
    assert len(load_text("austen")) == 24


@needs_debian
def test_story_prompts_continue_persuasion(fetched, tokenizer):
    fetched("austen")
    persuasion = load_text("austen")["text"]
    prompts = build_prompts("story", tokenizer, 80, 5)
    assert_sized(tokenizer, prompts, 80)
    assert all(in_any(p.text, persuasion) for p in prompts)


@needs_debian
def test_pydocs_splits_by_section(fetched):
    fetched("pydocs")
    splits = load_splits("pydocs")
    calibration, evaluation = splits[CALIBRATION], splits[EVALUATION]
    assert len(calibration) > 2000 and len(evaluation) > 400
    assert not titles(calibration) & titles(evaluation)
    assert "Built-in Functions" in titles(calibration) | titles(evaluation)
    assert not {"Top", "Index"} & (titles(calibration) | titles(evaluation))
    texts = list(calibration["text"]) + list(evaluation["text"])
    assert not any("*note" in t or "* Menu:" in t for t in texts)
