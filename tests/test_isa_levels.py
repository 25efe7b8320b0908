"""ISA levels (toolkit/cpu.py): $SPECQUANT_ISA selects a level this CPU has, every capability check answers as that
CPU would, and -- the point -- the kernel, decoder-stack and speculation-identity tests pass at every level this CPU
can run, not only its best: an AVX512 machine also runs them as an AVX2-only machine would (docs/kernels.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit import cpu
from toolkit.errors import InputError

# the speculation tests whose targets and drafts run specquant's kernels: identity with the target alone, the verify
# rule on models, the drafts (tests/test_spec_peers.py runs transformers' own assisted generation: no kernel of ours)
SPEC_TESTS = ("tests/test_spec.py", "tests/test_spec_verify.py", "tests/test_spec_drafts.py")
# the tests whose answers depend on the ISA the kernels were built for: the GEMMs, the KV kernel, the quantized
# layers' kernel choice, the native decoder stack (row independence), speculative identity on native targets
ISA_TESTS = ("tests/test_native_gemm.py", "tests/test_half_native.py", "tests/test_bf16_native.py", "tests/test_vnni.py",
             "tests/test_kv_kernel.py", "tests/test_qlinear.py", "tests/test_native_decoder.py",
             "tests/test_lean_forward.py", *SPEC_TESTS, "tests/test_native_dot_int8.py", "tests/test_kv_fp_store.py",
             "tests/test_native_kv_quantized.py", "tests/test_kv_window.py")
# at the portable level no SIMD kernel loads: the fallbacks' own tests and speculative identity on them (the verify
# rule and the drafts run the same torch code there as at the level above)
PORTABLE_TESTS = ("tests/test_native_gemm.py", "tests/test_kv_kernel.py", "tests/test_qlinear.py", "tests/test_spec.py")


@pytest.fixture
def fresh(monkeypatch):
    """toolkit.cpu with its caches cleared before and after, so a test can change what it reads."""
    def clear():
        for f in (cpu._cpuinfo, cpu.isa, cpu.flags):
            getattr(f, "cache_clear", lambda: None)()  # a test may have replaced _cpuinfo

    clear()
    yield monkeypatch
    clear()


def _fake_cpu(monkeypatch, flags: str):
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: {"flags": flags, "model name": "test CPU"})
    monkeypatch.setattr(cpu, "is_x86", lambda: True)


AMX = "sse4_2 avx avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_tile amx_bf16 amx_int8"


def test_the_default_level_is_the_best_the_cpu_has(fresh):
    fresh.delenv(cpu.ISA_ENV, raising=False)
    _fake_cpu(fresh, AMX)
    assert cpu.available_levels() == cpu.LEVELS and cpu.isa() == "amx" and cpu.has("amx_bf16", "avx512f")
    _fake_cpu(fresh, "sse4_2 avx avx2 fma f16c")
    assert cpu.available_levels() == ("portable", "avx2")


@pytest.mark.parametrize("level, has, lacks", [
    ("avx512", {"avx512f", "avx512_vnni", "avx512_bf16", "avx2"}, {"amx_tile", "amx_bf16"}),
    ("avx2", {"avx2", "fma", "f16c"}, {"avx512f", "avx512_bf16", "amx_bf16"}),
    ("portable", {"sse4_2"} - {"sse4_2"}, {"avx2", "fma", "f16c", "avx512f"}),
])
def test_a_lower_level_hides_what_is_above_it(fresh, level, has, lacks):
    _fake_cpu(fresh, AMX)
    fresh.setenv(cpu.ISA_ENV, level)
    assert cpu.isa() == level
    assert has <= cpu.flags() and not (lacks & cpu.flags())
    assert cpu.native_bf16() == (level == "avx512")
    assert cpu.hardware_flags() >= lacks  # the hardware's own flags are still there for the record


def test_the_compiler_targets_the_level(fresh):
    _fake_cpu(fresh, AMX)
    expected = {"portable": "-march=x86-64", "avx2": "-march=x86-64-v3", "avx512": "-mno-amx-tile",
                "amx": "-march=native"}
    for level, flag in expected.items():
        fresh.setenv(cpu.ISA_ENV, level)
        cpu.isa.cache_clear()
        assert flag in cpu.march()
    cpu.isa.cache_clear()


def test_a_level_the_cpu_lacks_or_a_misspelt_one_is_a_clear_error(fresh):
    _fake_cpu(fresh, "avx avx2 fma f16c")
    fresh.setenv(cpu.ISA_ENV, "avx512")
    with pytest.raises(InputError, match="(?s)avx512f.*use one of portable, avx2"):
        cpu.isa()
    cpu.isa.cache_clear()
    fresh.setenv(cpu.ISA_ENV, "avx-512")
    with pytest.raises(InputError, match="not an ISA level"):
        cpu.isa()
    with pytest.raises(InputError):
        cpu.environment("sse")


def test_a_child_at_a_level_holds_torch_to_it_too():
    env = cpu.environment("avx2")
    assert env[cpu.ISA_ENV] == "avx2" and env["ATEN_CPU_CAPABILITY"] == "avx2"


LOWER = [level for level in cpu.available_levels() if level != cpu.isa()]


@pytest.mark.isa_matrix
@pytest.mark.parametrize("level", LOWER or [pytest.param("none", marks=pytest.mark.skip(
    reason="this CPU has no level below the one the suite runs at"))])
def test_the_kernel_and_speculation_tests_pass_at_every_lower_level(level, tmp_path):
    """The ISA-dependent test files, run in a child process at `level` (kernels built for it, torch held to it)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, **cpu.environment(level)}
    tests = PORTABLE_TESTS if level == "portable" else ISA_TESTS
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                         cwd=root, env=env, capture_output=True, text=True, timeout=1500, check=False)
    tail = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, f"at SPECQUANT_ISA={level}:\n{tail}"
    assert " passed" in run.stdout.splitlines()[-1], tail


def test_kernel_messages_go_to_stderr_never_into_the_generated_text(tiny_llama_dir):
    """At the portable level no C kernel loads and each says so in the log: on stderr, while stdout carries only
    the generated text."""
    from tests.test_cli import specquant

    run = specquant("generate", f"model={tiny_llama_dir}", "prompt=The syntax of", "new_tokens=3",
                    env={cpu.ISA_ENV: "portable"})
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("The syntax of")
    assert "kernel" in run.stderr  # the messages were there to be misplaced
    assert "kernel" not in run.stdout and "AVX" not in run.stdout
