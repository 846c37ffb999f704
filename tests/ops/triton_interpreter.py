"""Running a test file's Triton kernels on CPU, in the Triton interpreter, in a fresh process.

TRITON_INTERPRET must be set before triton is first imported: it is read when @triton.jit decorates,
and that includes triton.language's own jit helpers, which an interpreted kernel can only call if they
are interpreted too. In a whole-suite run triton is already imported, so the kernels run in a worker
process: the test file run as a script, which torch.saves its inputs and outputs to the path it is
given. The comparisons with the references then run in the test process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_interpreter_worker(test_file: str, out_dir: Path, timeout_s: float = 300) -> dict:
    """Run `python test_file OUT` with TRITON_INTERPRET=1 and return what it saved to OUT."""
    out = out_dir / "results.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    paths = [str(REPO_ROOT), str(REPO_ROOT / "tests"), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    done = subprocess.run([sys.executable, str(Path(test_file).resolve()), str(out)], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"interpreter worker failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return torch.load(out)


def require_interpreted(kernel: object) -> None:
    """In the worker: raise unless `kernel` (a @triton.jit function) is interpreted."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError("TRITON_INTERPRET=1 was not picked up: the kernels are compiled, not interpreted")


def save_case_results(out_path: str, case_ids: Iterable[str], run_case: Callable[[str], dict]) -> None:
    """In the worker: torch.save {case id: run_case(case id)} to out_path, a case that raised saved as
    {"error": its traceback}, so one bad case fails its own test and not the others."""
    results = {}
    for case_id in case_ids:
        try:
            results[case_id] = run_case(case_id)
        except Exception:
            results[case_id] = {"error": traceback.format_exc()}
    torch.save(results, out_path)


def case_result(results: dict, case_id: str) -> dict:
    """In the test: one case's saved result; fails the test with the worker's traceback if it raised."""
    result = results[case_id]
    if "error" in result:
        pytest.fail(f"kernel raised in the interpreter:\n{result['error']}")
    return result
