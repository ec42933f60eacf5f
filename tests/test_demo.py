"""``make demo`` as a user sees it: the whole product in one run, with no warnings and a table that says what its
columns mean."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_demo_runs_end_to_end_without_warnings_and_explains_its_table() -> None:
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, "-m", "kvtier.tools.demo", "--conversations", "1", "--turns", "2"],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Warning" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    out = " ".join(done.stdout.split())  # rich wraps long lines at the terminal's width
    for legend in ("decode hit (+N)", "match ", "replay ", "Turn 0 of the first conversation has nothing to reuse"):
        assert legend in out
    assert "P/D outputs equal the single-process reference in 2/2 turns" in out
