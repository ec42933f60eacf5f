"""``make demo`` as a newcomer runs it: a fresh clone of the repository, where ``make demo`` makes its own ``.venv``
and installs what the demo imports (the ``demo`` extra) before running it, never the test environment. The whole
product in one run: exit status 0, no traceback, no warning, reuse and TTFT shown, and a table that says what its
columns mean.

Its cost (pip's cache and the local torch wheel make the set-up a local copy): on this 2-core machine the set-up
takes ~50 s of CPU (``PIP_NO_COMPILE``: the pyc files are written as the demo imports modules, not for all of
torch's), the demo ~35 s, 1.5 to 3 minutes of wall time with the machine shared."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# this machine's pip configuration names index folders that lack some packages, and pip says so for each: that is
# the machine's, not the demo's
PIP_INDEX_NOTE = re.compile(r"WARNING: Location 'file:[^']*' is ignored: it is neither a file nor a directory\.")
# the environment this test runs in: the fresh clone's make must not see it
OUTER = ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")


def fresh_clone(dest: Path) -> Path:
    """A ``git clone`` of this repository, with this working tree's uncommitted changes copied over (none in CI,
    whose checkout is a clean clone), so the test checks what is about to land."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    changed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--modified", "--others", "--exclude-standard"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    for name in filter(None, changed.split("\0")):
        source, target = ROOT / name, dest / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
        elif target.exists():  # deleted here, not yet committed
            target.unlink()
    return dest


def newcomer_env() -> dict[str, str]:
    """This environment less the test's virtual environment and the outer make, as a new user's shell has it."""
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if k not in OUTER}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != venv_bin)
    return env | {"COLUMNS": "100", "PIP_NO_COMPILE": "1"}


def test_make_demo_in_a_fresh_clone_installs_what_it_imports_and_shows_reuse_and_ttft() -> None:
    with tempfile.TemporaryDirectory(prefix="kvtier-clone-") as tmp:  # ~1 GB once installed: never kept
        clone = fresh_clone(Path(tmp, "kvtier"))
        done = subprocess.run(
            ["make", "demo", "DEMO_ARGS=--conversations 1 --turns 2"], cwd=clone, env=newcomer_env(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1500,
        )  # fmt: skip
        installed = (clone / ".venv" / ".demo-installed").is_file()
    output = PIP_INDEX_NOTE.sub("", done.stdout)
    assert done.returncode == 0, output[-4000:]
    assert installed and "-m pip install -q -e '.[demo]'" in output
    assert not re.search(r"traceback|warning", output, re.IGNORECASE), output
    out = " ".join(output.split())  # rich wraps long lines at the terminal's width
    for legend in ("decode hit (+N)", "match ", "replay ", "Turn 0 of the first conversation has nothing to reuse"):
        assert legend in out
    reused = re.search(r"prefill reused (\d+) of \d+ prompt tokens .*? TTFT with reuse \d+\.\d× faster", out)
    assert reused and int(reused.group(1)) > 0, out
    assert "P/D outputs equal the single-process reference in 2/2 turns" in out
    http_turns = re.findall(r"│\s+(\d)\s+│\s+\d+\s+│\s+(\d+)\s+│\s+\d+ ms\s+│\s+\d+ ms \((\d+) cached\)", output)
    assert [turn for turn, _, _ in http_turns] == ["0", "1", "2"], output
    assert all(int(cached) > 0 and int(fresh) == 0 for _, cached, fresh in http_turns[1:]), http_turns
