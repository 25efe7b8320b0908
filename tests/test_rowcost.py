"""The row-cost bench (benchmarks/rowcost.py): every setting the CPU can run is timed at every row count, the
one-row step is the unit, and the AMX switch is left as it was found."""

import pytest

from toolkit.quant import bf16_native

pytestmark = pytest.mark.skipif(not bf16_native.available(),
                                reason="the bf16 setting needs the bf16 kernel (AVX512-BF16)")


def test_every_setting_is_timed_at_every_row_count(tiny_llama_dir, capsys):
    from benchmarks.rowcost import print_result, run

    before = bf16_native.amx_in_use()
    out = run(str(tiny_llama_dir), [1, 3, 20], rounds=2, passes=1, context=8)
    assert bf16_native.amx_in_use() == before
    has_amx = bf16_native.set_amx(True)
    bf16_native.set_amx(before)
    assert list(out["ms"]) == ["fp32", "bf16"] + (["bf16-amx"] if has_amx else [])
    for name, per in out["ms"].items():
        assert list(per) == [1, 3, 20] and all(ms > 0 for ms in per.values())
        assert out["steps"][name][1] == 1.0 and out["steps"][name][20] == per[20] / per[1]
    assert out["memory_bandwidth_gbs"] > 0
    print_result(out)
    assert "in 1-row steps" in capsys.readouterr().out


def test_rows_must_start_at_one():
    from benchmarks.rowcost import main

    with pytest.raises(SystemExit):
        main(["--rows", "2", "4"])
