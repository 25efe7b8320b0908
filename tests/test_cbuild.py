"""toolkit/cbuild.py: kernel sources found by name in toolkit/kernels/, a library keyed by its source and the headers
it includes (a changed header rebuilds what includes it), and the folder shipped whole in the wheel."""

import ctypes
import fnmatch
from pathlib import Path

import pytest

from toolkit import cbuild

ROOT = Path(__file__).resolve().parent.parent


def test_every_kernel_source_is_in_the_one_folder_and_ships():
    files = sorted(p.name for p in cbuild.KERNELS.iterdir() if p.suffix in (".c", ".h"))
    assert {"int4_gemm.c", "int8_gemm.c", "half_gemm.c", "bf16_gemm.c", "vnni_gemm.c", "decoder_layers.c",
            "dequant.c", "tiles.h"} <= set(files)
    assert all(cbuild.source(name).is_file() for name in files)
    assert not [p for p in (ROOT / "toolkit").rglob("*.[ch]") if p.parent != cbuild.KERNELS], "C outside kernels/"
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["toolkit"]
    unshipped = [f for f in files if not any(fnmatch.fnmatch(f"kernels/{f}", g) for g in globs)]
    assert not unshipped, f"add these to pyproject.toml's package data: {unshipped}"


def test_the_decoder_stack_keys_on_everything_it_includes():
    included = {p.name for p in cbuild.quoted_includes(cbuild.source("decoder_layers.c"))}
    assert included == {"tiles.h", "int4_gemm.c", "int8_gemm.c", "half_gemm.c", "bf16_gemm.c", "vnni_gemm.c",
                        "attention.c"}
    assert [p.name for p in cbuild.quoted_includes(cbuild.source("int4_gemm.c"))] == ["tiles.h"]


def test_a_changed_header_rebuilds_the_library(tmp_path, monkeypatch):
    cc = cbuild.compiler()
    if not cc:
        pytest.skip("no C compiler")
    monkeypatch.setenv("SPECQUANT_HOME", str(tmp_path / "home"))
    header, source = tmp_path / "value.h", tmp_path / "value.c"
    header.write_text("#define VALUE 1\n")
    source.write_text('#include "value.h"\nint value(void) { return VALUE; }\n')
    flags = ["-O1", "-shared", "-fPIC"]
    first = cbuild.build(source, "value", cc, flags)
    assert cbuild.build(source, "value", cc, flags) == first  # cached
    header.write_text("#define VALUE 2\n")
    second = cbuild.build(source, "value", cc, flags)
    assert second != first and ctypes.CDLL(str(second)).value() == 2
