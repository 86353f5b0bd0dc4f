"""autoopt on JAX's multi-process runtime (issue 17): two local processes of one
``jax.distributed`` job, 2 CPU devices each, gloo collectives (``multiprocess_worker.py``).

Every run is under a time limit: a hang (mismatched collectives, a process waiting for another
that never answers) fails the test with both processes' output instead of stalling CI.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")
LIMIT_S = 240  # a run takes 5-15 s here; anything near this is a hang


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _job(scenario: str, workers: tuple[Path, Path] = (WORKER, WORKER), **env: str) -> list[dict]:
    port = str(_free_port())
    full_env = {**os.environ, **env, "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(workers[pid]), scenario, str(pid), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
        )
        for pid in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=LIMIT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [(p.communicate()[0] or "")[-3000:] for p in procs]
        pytest.fail(f"the job {scenario!r} hung for {LIMIT_S} s:\n" + "\n---\n".join(tails))
    results = []
    for pid, out in enumerate(outputs):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, f"process {pid} printed no result:\n{out[-3000:]}"
        r = json.loads(lines[-1][len("RESULT ") :])
        assert "crash" not in r, f"process {pid} crashed:\n{r['crash']}"
        results.append(r)
    return results


def test_a_data_parallel_step_donates_remats_and_matches_jax_jit(tmp_path):
    # donation at the rebinding call (the old buffer holds the new parameters), a remat plan
    # (a memory budget), batches from process-local NumPy through autoopt.prefetch; the two
    # processes run the script from different folders, as hosts with their own checkouts do
    copies = (tmp_path / "host0" / WORKER.name, tmp_path / "host1" / WORKER.name)
    for c in copies:
        c.parent.mkdir()
        shutil.copy(WORKER, c)
    a, b = _job("train", workers=copies)
    for r in (a, b):
        assert r["losses_equal"] and r["max_abs_diff"] == 0.0, r
        assert r["donated"] == [True] * 4, r
        assert r["remat_applied"], r
        assert r["executable_donates"] == [[0], []], r
        assert not r["warnings"], r
    assert a["program"] == b["program"]


def test_measurements_that_disagree_still_give_every_process_the_same_program():
    # process 1's compiles report no temporary memory (no plan would be needed there) and its
    # call site keeps the state (it must not donate): it takes process 0's remat plan and
    # executable, and passes copies where process 0 donates
    p0, p1 = _job("disagree")
    assert p0["program"] == p1["program"]
    assert p0["remat_applied"] and p1["remat_applied"]
    assert p0["executable_donates"] == p1["executable_donates"] == [[0], []]
    assert p0["donated"] == [True] * 4 and p1["donated"] == [False] * 4
    for r in (p0, p1):
        assert r["losses_equal"] and r["max_abs_diff"] == 0.0, r


def test_an_argument_structure_that_differs_between_processes_is_an_error_naming_it():
    p0, p1 = _job("mismatch", AUTOOPT_PROCESS_TIMEOUT_S="60")
    for r, other in ((p0, 1), (p1, 0)):
        assert "argument x float32[" in r["error"], r
        assert f"where process {other} has x float32[" in r["error"], r
        assert "make_array_from_process_local_data" in r["error"]


def test_work_on_one_process_alone_runs_as_under_jax_jit():
    """A program whose arguments are one process's own runs there alone, as under jax.jit: a
    metric, a report or a lowering on process 0 only (by a function made before or after
    ``initialize()``), and process-local shapes that differ, neither wait for the other process
    (which never calls) nor are compared with it."""
    p0, p1 = _job("local", AUTOOPT_PROCESS_TIMEOUT_S="60")
    assert p0["report"] == "Report" and p0["alone"] == pytest.approx(5 / 3), p0
    assert p0["metrics"] == pytest.approx([55 / 6, 55 / 6, 14 / 4]), p0
    assert p0["early"] == [5.0, 5.0, 14.0] and p0["lowered"] == 1.0, p0
    assert p1["metrics"] == pytest.approx([55 / 6, 30 / 5]), p1
    assert p0["losses_equal"] and p1["losses_equal"], (p0, p1)
