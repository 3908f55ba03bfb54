"""`mla-ops selftest` on the CPU: one row per op x selftest sample x dtype from the case database, each
naming the backend that serves it and judged against the reference kernel on the CPU and the oracle;
measurements reported as INFO, never as a verdict; a wrong kernel is a FAIL and exit status 1."""
import torch

from mla_ops import backends
from mla_ops.cli import main
from mla_ops.cli.selftest import SELFTEST_DTYPES
from mla_ops.testing.cases import CASES


def _rows(out: str) -> dict[str, str]:
    table = out.split("\ncheck ", 1)[1]
    lines = table.splitlines()
    return {line.split("  ")[0]: line for line in lines[2:-1]}, lines[-1]


def test_selftest_on_cpu_covers_every_op_and_names_the_serving_backend(capsys):
    assert main(["selftest"]) == 0
    rows, summary = _rows(capsys.readouterr().out)
    for op, cases in CASES.items():
        assert cases.selftest, f"mla.{op} has no selftest sample"
        for dtype_name, dtype in SELFTEST_DTYPES.items():
            for name in cases.selftest:
                row = rows[f"{op} {name} {dtype_name}"]
                served, _ = backends.choose(op, *cases.sample(dtype, name).args, **cases.sample(dtype, name).kwargs)
                assert f" PASS     {served.name}" in row, row
                if cases.bound("reference", dtype) == 0:
                    assert "bit-exact vs the reference kernel on cpu and the oracle" in row, row
                elif served.name == "reference":
                    assert "vs oracle" in row and "the reference kernel on cpu serves this call" in row, row
                else:
                    assert "vs reference kernel on cpu" in row and "vs oracle" in row, row
    assert rows["host time per kv_prolog call"].split()[5] == "INFO"
    assert "SKIP" in rows["pypto_sim backend"] and "--pypto-sim" in rows["pypto_sim backend"]
    ops_rows = sum(len(c.selftest) for c in CASES.values()) * len(SELFTEST_DTYPES)
    assert summary == f"{ops_rows} passed, 0 failed, 2 skipped, 3 reported", summary


def test_a_wrong_kernel_fails_the_selftest(capsys):
    """A kernel registered on the CPU key (of an op no native kernel serves) that scales its result by 1.01 is
    caught by the oracle."""
    from mla_ops.ops.rope import rope_math

    wrong = torch.library.Library("mla", "IMPL")
    try:
        def scaled_rope(x, cos, sin, *, layout="interleaved", compute_dtype="float32"):
            return rope_math(x, cos, sin, layout, compute_dtype) * 1.01

        wrong.impl("rope", scaled_rope, "CPU")
        assert main(["selftest"]) == 1
    finally:
        wrong._destroy()
    rows, summary = _rows(capsys.readouterr().out)
    assert " FAIL " in rows["rope v2lite fp32"] and "vs oracle" in rows["rope v2lite fp32"]
    assert " 0 failed" not in summary
