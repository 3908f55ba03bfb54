"""What a simulated kernel call reports: the verifier's verdicts (read from pypto's plog) and the
simulated AICore time (read from the cost model's output files)."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import compat

# pypto's swim-lane script converts cycles to microseconds with --time_convert_denominator=1800
# (the modelled ASCEND_910B2 AICore clock, 1.8 GHz).
SIM_CLOCK_MHZ = 1800

# The passes the verifier checks by default (pypto 0.2.0 docs, set_verify_options).
DEFAULT_VERIFIED_PASSES = ("ExpandFunction", "SplitK", "L1CopyInReuseMerge", "InferDynShape",
                           "InferParamIndex", "CodegenPreproc")

_VERDICT_RE = re.compile(
    r"\[VERIFY\]:(?:ErrCode: \w+! )?(?P<what>\S+) Verify for \d+ data view list index (?P<idx>\d+) "
    r"result (?P<res>PASS|FAILED|NO_COMPARE)")
_PASS_ERROR_RE = re.compile(
    r"VerifyPass failed for function (?P<func>\S+), pass (?P<pass>\w+) "
    r"\(passIndex: \d+, captureIndex: \d+\): "
    r"(?:Errcode: )?(?P<code>[^!\n]*)")



class _PlogTail:
    """Lines appended to this process's pypto plog files since construction."""

    def __init__(self) -> None:
        self._pos = {f: os.path.getsize(f) for f in self._files()}

    @staticmethod
    def _files() -> List[str]:
        return sorted(glob.glob(str(compat.plog_root() / "**" / f"pypto-log-{os.getpid()}_*.log"), recursive=True))

    def read(self) -> List[str]:
        lines: List[str] = []
        for f in self._files():
            with open(f, "r", errors="replace") as fh:
                fh.seek(self._pos.get(f, 0))
                lines.extend(fh.read().splitlines())
        return lines


def parse_verify_lines(lines: Sequence[str]) -> Tuple[List[Tuple[str, int, str]], List[Tuple[str, str]]]:
    """Plog lines -> (verdicts [(what, index, PASS|FAILED|NO_COMPARE)], pass errors [(func_pass, code)]).

    ``what`` is ``tensor_graph`` (kernel argument ``index`` against its golden) or
    ``<function>_Pass_NN_<PassName>`` (output ``index`` of that pass against the tensor graph).
    Pass errors mean the pass interpreter could not evaluate the graph (e.g. ``FB200B``
    GetValidDataView before InferDynShape, a documented limitation), not a numeric mismatch.
    """
    verdicts, errors = [], []
    for line in lines:
        m = _VERDICT_RE.search(line)
        if m:
            verdicts.append((m["what"], int(m["idx"]), m["res"]))
            continue
        m = _PASS_ERROR_RE.search(line)
        if m:
            errors.append((f"{m['func']}:{m['pass']}", m["code"].split(",")[-1].strip()))
    return verdicts, errors


# ----------------------------------------------------------------------------------------------
# SIM cost-model time
# ----------------------------------------------------------------------------------------------
def sim_aicore_e2e_us(sim_dir: os.PathLike) -> float:
    """pypto's printed 'AICore End-to-End Time': (last AIC/AIV task end - first start) / 1800 MHz.

    Read from ``_simulate.swim.json``; excludes AICPU scheduling before the first AICore task.
    """
    with open(Path(sim_dir, "_simulate.swim.json")) as fh:
        lanes = json.load(fh)
    starts, ends = [], []
    for lane in lanes:
        if not any(k in lane.get("coreType", "") for k in ("AIC", "AIV")):
            continue
        for task in lane.get("tasks", []):
            if task["execEnd"] >= task["execStart"]:
                starts.append(task["execStart"])
                ends.append(task["execEnd"])
    return (max(ends) - min(starts)) / SIM_CLOCK_MHZ if starts else 0.0


def sim_total_cycles(sim_dir: os.PathLike) -> int:
    """'Total Cycles' of ``_simulate.stat.report.txt`` (whole simulated run incl. AICPU scheduling)."""
    text = Path(sim_dir, "_simulate.stat.report.txt").read_text(errors="replace")
    m = re.search(r"Total Cycles\.*:\s*(\d+)", text)
    if not m:
        raise RuntimeError(f"no 'Total Cycles' in {sim_dir}/_simulate.stat.report.txt")
    return int(m.group(1))


@dataclasses.dataclass
class SimResult:
    """One simulated kernel call.

    verdicts: ``(what, index, verdict)`` per comparison (see :func:`parse_verify_lines`).
    failed:   the FAILED verdicts (a run with any raises :class:`SimVerificationError`).
    errors:   ``(function:pass, code)`` pass-interpreter errors -- passes that could not be checked.
    aicore_us / total_cycles: simulated AICore end-to-end time (µs at 1.8 GHz) and total cycles.
    wall_s:   host wall time of the call (compile + verify + cost model).
    work_dir: pypto's working directory for the call (deleted unless MLA_OPS_PYPTO_KEEP_OUTPUT=1).
    """

    kernel: str
    outputs: Dict[str, torch.Tensor]
    verdicts: List[Tuple[str, int, str]]
    failed: List[Tuple[str, int, str]]
    errors: List[Tuple[str, str]]
    aicore_us: float
    total_cycles: int
    wall_s: float
    work_dir: Optional[str] = None

    @property
    def passed(self) -> int:
        return sum(v[2] == "PASS" for v in self.verdicts)

    @property
    def tensor_graph(self) -> List[str]:
        """Verdicts of the kernel arguments against the goldens, in argument order."""
        return [v[2] for v in self.verdicts if v[0] == "tensor_graph"]

    def summary(self) -> str:
        codes = sorted({f"{e[0].rsplit(':', 1)[-1]}={e[1]}" for e in self.errors})
        return (f"{self.kernel}: {self.aicore_us:.2f} us AICore ({self.total_cycles} cycles), "
                f"{self.passed} PASS / {len(self.failed)} FAILED, unchecked passes {codes}, "
                f"wall {self.wall_s:.2f} s")


class SimVerificationError(AssertionError):
    """A simulated kernel produced a FAILED verdict (a pass disagrees with the tensor graph, or an
    output disagrees with its golden)."""

    def __init__(self, result: SimResult):
        self.result = result
        shown = ", ".join(f"{w}[{i}]" for w, i, _ in result.failed[:8])
        super().__init__(f"PyPTO simulation of {result.kernel} reported {len(result.failed)} FAILED "
                         f"verdict(s): {shown}. Rerun with MLA_OPS_PYPTO_KEEP_OUTPUT=1 and read "
                         f"output/*/verify_*/ and the plog under {compat.plog_root()} for the mismatching elements.")
