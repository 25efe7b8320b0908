"""The layers hold (docs/architecture.md): data flows one way, recipe -> quantize -> checkpoint -> load -> engine ->
eval/bench/serve, and no package imports one above it -- at module level or inside a function."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "toolkit"

# lowest first; a package may import its own layer's packages' peers only where listed together below
LAYERS = [
    # machine facts, kernels' build cache, file and path helpers, timing, the pass flags, the results store
    {"toolkit", "errors", "paths", "fileio", "cpu", "cbuild", "machine", "timing", "passes", "results", "settings",
     "model_state"},
    {"data", "models"},  # offline text; the model registry, fetch and load
    {"quant"},  # kernels' wrappers, primitives, GPTQ/AWQ/RTN, quantized layers, checkpoints and formats
    {"kv"},  # KV caches: contiguous, quantized, paged
    {"engine"},  # precision, the lean forward and native stack, prefill/decode, sampling
    {"spec"},  # drafts, verification, the speculative loop
    {"evaluation", "serve", "report"},  # applications over the engine
    {"bench", "diagnose"},  # measurements, which may drive the applications (the server, evaluation tasks)
    {"cli", "__main__"},  # commands: configuration resolved into the objects above
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# the allowed directions, for the record: each layer may import its own and every layer listed before it
ALLOWED = {name: set().union(*LAYERS[:LEVEL[name] + 1]) for name in LEVEL}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "toolkit"


def _is_module(name: str) -> bool:
    return (ROOT / f"{name}.py").exists() or (ROOT / name / "__init__.py").exists()


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported toolkit module, line) for every import in the file, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "toolkit":
            if node.module == "toolkit":  # from toolkit import cpu, cbuild (modules) or __version__ (a name)
                found += [(f"toolkit.{alias.name}" if _is_module(alias.name) else "toolkit", node.lineno)
                          for alias in node.names]
            else:
                found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "toolkit"]
    return found


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if (p.is_dir() and (p / "__init__.py").exists())}
    modules = {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    missing = (packages | modules) - set(LEVEL)
    assert not missing, f"place these in LAYERS: {sorted(missing)}"


def test_no_package_imports_a_higher_layer():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
        source = _package(module)
        for target, line in _imports(path):
            imported = _package(target)
            if imported not in ALLOWED[source]:
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line} ({source}) imports {target} ({imported})")
    assert not wrong, "lower layers must not import higher ones:\n" + "\n".join(wrong)


def test_the_check_catches_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from toolkit.engine.generate import generate\n")
    assert ("toolkit.engine.generate", 2) in _imports(bad)
    assert "engine" not in ALLOWED["quant"] and "engine" in ALLOWED["spec"]


# the command line's entry stays light (`specquant --help` and `specquant models list` load no torch): it imports a
# command's module, and the engine's typed settings, only for the commands that use them; the models package loads
# its torch half (load_model) on first use for the same reason
LAZY_ON_PURPOSE = {"toolkit/cli/__init__.py", "toolkit/cli/app.py", "toolkit/models/__init__.py"}


def _function_level_imports(path: Path) -> list[tuple[str, int]]:
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [(node.module or ".", node.lineno) for node in ast.walk(fn)
                      if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("toolkit"))]
    return found


def test_no_import_circle_hides_in_a_function():
    """Every toolkit module imports the toolkit modules it uses at its top: a function-level import of one would
    hide an import circle (the layers above forbid the upward half of one, this the rest)."""
    hidden = [f"{path.relative_to(ROOT.parent)}:{line} imports {module} inside a function"
              for path in sorted(ROOT.rglob("*.py")) if str(path.relative_to(ROOT.parent)) not in LAZY_ON_PURPOSE
              for module, line in _function_level_imports(path)]
    assert not hidden, "\n".join(hidden)
    bad = ROOT.parent / "tests" / "test_layers.py"  # the check sees one: this file's own helper is not toolkit's
    assert _function_level_imports(bad) == []
