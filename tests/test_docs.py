"""Every command in the README and in ``docs/*.md`` runs as written, against a real temporary cluster.

The marker convention (README, "Every command here runs"), for whoever adds a section:

- ```` ```sh ````: run with ``bash -euo pipefail``, in ``$KVTIER_HOME``, with this environment's commands first on
  ``PATH``; it must exit 0.
- ```` ```sh server ````: each command line (``\\`` continues it; a trailing ``&`` and comments are dropped) is a
  long-running server: started in the background, awaited until it prints a line with ``ready`` on stdout, and
  stopped (SIGTERM, then SIGKILL) after the last document.
- ```` ```python ````: run with this interpreter, in ``$KVTIER_HOME``.
- ```` ```sh skip="why" ```` or ```` ```python skip="why" ````: not run; the test is reported skipped with the reason.
- Any other fence (none, ``text``, ``toml``, ...) is not a command. ``bash``, ``shell``, ``console``, ``py`` fences
  fail: write ``sh`` or ``python`` so that nothing escapes this test.

The documents run as one session, the README first, then ``docs/*.md`` by name, one test per block in order: a
block may use what earlier ones made or started. ``$KVTIER_HOME`` is a fresh folder, ``$KVTIER_DIRECTORY`` and
``$KVTIER_PORT`` free local ports, ``$KVTIER_POOL`` a shared-memory name no other run uses; ``$KVTIER_TOKEN`` and
``$KVTIER_CONFIG`` start unset.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtier.kvstore.cluster.config import PORT_RANGE_ENV, free_ports, port_range

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNERS = ("sh", "python")
REFUSED = ("bash", "shell", "console", "zsh", "py", "python3")  # fences that look runnable but would not be run
BLOCK_TIMEOUT_S = 300.0
READY_TIMEOUT_S = 120.0
RESERVED_PORTS = 100  # at the bottom of this process's port range: the servers the blocks start
_FENCE = re.compile(r"^```(.*)$")
_READY = re.compile(r"\bready\b")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language, its markers, its text."""

    path: Path
    line: int
    lang: str
    server: bool
    skip: str | None
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The runnable (or skip-marked) blocks of a Markdown file, in order; ValueError for a fence this test would
    miss or a marker it does not know."""
    found: list[Block] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        start, info = i + 1, opening.group(1).strip()
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        text = "\n".join(lines[start:i]) + "\n"
        i += 1
        words = shlex.split(info) if info else []
        lang = words[0] if words else ""
        if lang in REFUSED:
            raise ValueError(
                f"{path.name}:{start}: a ```{lang} block: write ```sh or ```python (see tests/test_docs.py)"
            )
        if lang not in RUNNERS:
            continue
        server, skip = False, None
        for word in words[1:]:
            if word == "server" and lang == "sh":
                server = True
            elif word.startswith("skip=") and word[5:]:
                skip = word[5:]
            else:
                raise ValueError(f'{path.name}:{start}: unknown marker {word!r} (server, skip="why")')
        found.append(Block(path, start, lang, server, skip, text))
    return found


ALL = [block for path in DOCUMENTS for block in blocks(path)]


def server_commands(text: str) -> list[str]:
    """The command lines of a ``sh server`` block: continuations joined, comments and a trailing ``&`` dropped."""
    commands, current = [], ""
    for raw in text.splitlines():
        line = re.sub(r"\s+#.*$", "", raw).rstrip()
        if line.lstrip().startswith("#") or not line:
            continue
        if line.endswith("\\"):
            current += line[:-1].strip() + " "
            continue
        commands.append(re.sub(r"\s*&$", "", current + line.strip()))
        current = ""
    return commands


class Session:
    """The documents' shared world: the folder, the environment, and the servers their blocks started."""

    def __init__(self, home: Path) -> None:
        self.home = home
        env = {k: v for k, v in os.environ.items() if k not in ("KVTIER_TOKEN", "KVTIER_CONFIG")}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env["KVTIER_HOME"] = str(home)
        # the servers' ports are picked now and bound blocks later: the blocks' own programs (kvstore init) pick
        # theirs from above them, never one of these (README.md:198's directory found its port taken, once)
        low, high = port_range(RESERVED_PORTS)
        directory, serve = free_ports(2, within=(low, low + RESERVED_PORTS))
        env[PORT_RANGE_ENV] = f"{low + RESERVED_PORTS}-{high}"
        env["KVTIER_DIRECTORY"] = f"127.0.0.1:{directory}"
        env["KVTIER_POOL"] = f"kvtier-doctest-{secrets.token_hex(4)}"
        env["KVTIER_PORT"] = str(serve)
        env["COLUMNS"] = "120"
        self.env = env
        self.servers: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def run(self, block: Block) -> None:
        argv = (
            ["bash", "-euo", "pipefail", "-c", block.text] if block.lang == "sh" else [sys.executable, "-c", block.text]
        )
        try:
            done = subprocess.run(
                argv, cwd=self.home, env=self.env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: did not finish within {BLOCK_TIMEOUT_S:.0f} s:\n{block.text}")
        if done.returncode != 0:
            pytest.fail(
                f"{block.where}: exit status {done.returncode}\n--- block\n{block.text}--- stdout\n"
                f"{done.stdout[-3000:]}--- stderr\n{done.stderr[-3000:]}"
            )

    def start(self, block: Block) -> None:
        for command in server_commands(block.text):
            out = self.home / f"server-{len(self.servers)}.out"
            with open(out, "wb") as stdout, open(out.with_suffix(".err"), "wb") as stderr:
                proc = subprocess.Popen(
                    ["bash", "-c", f"exec {command}"], cwd=self.home, env=self.env, stdout=stdout, stderr=stderr,
                    stdin=subprocess.DEVNULL, start_new_session=True,
                )  # fmt: skip
            self.servers.append((command, proc, out))
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not _READY.search(out.read_text(errors="replace")):
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = out.with_suffix(".err").read_text(errors="replace")[-3000:]
                    state = f"exited with status {proc.returncode}" if proc.poll() is not None else "never said ready"
                    pytest.fail(f"{block.where}: `{command}` {state}:\n{err}")
                time.sleep(0.1)

    def stop(self) -> None:
        """Stop the servers, the last started first (a fetcher before the nodes it reads from)."""
        for _, proc, _ in reversed(self.servers):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    world = Session(tmp_path_factory.mktemp("kvtier-home"))
    try:
        yield world
    finally:
        world.stop()


@pytest.mark.parametrize("block", ALL, ids=[b.where for b in ALL])
def test_the_block_runs_as_written(block: Block, session: Session) -> None:
    if block.skip is not None:
        pytest.skip(f"marked not runnable here: {block.skip}")
    if block.server:
        session.start(block)
    else:
        session.run(block)


def test_the_documents_have_runnable_blocks_and_every_skip_says_why() -> None:
    assert {b.path.name for b in ALL if b.skip is None} >= {"README.md"}
    assert all(len(b.skip) >= 10 for b in ALL if b.skip is not None)


def test_a_runnable_looking_fence_or_an_unknown_marker_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.md"
    bad.write_text("# x\n\n```bash\nls\n```\n")
    with pytest.raises(ValueError, match="write ```sh or ```python"):
        blocks(bad)
    bad.write_text("# x\n\n```sh gpu\nls\n```\n")
    with pytest.raises(ValueError, match="unknown marker 'gpu'"):
        blocks(bad)
    bad.write_text("# x\n\n```sh server\nkvstore serve a.toml &  # comment\nkvtier-fetcher \\\n    --x y &\n```\n")
    [block] = blocks(bad)
    assert server_commands(block.text) == ["kvstore serve a.toml", "kvtier-fetcher --x y"]
