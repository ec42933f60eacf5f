"""``make demo``: the whole product on this machine, saying what happened.

The set-up (:func:`setup`) writes a cluster file into a temporary directory and starts 12 node processes, the
host's fetcher (shared memory staging pool), the StateBlock directory, and a seeded tiny checkpoint. Then each
part of :data:`PARTS` runs in turn against it (``--parts`` picks some), numbering its steps after the last one's:

``workers``
    a **prefill** and a **decode** worker (separate processes with their own paged caches; they meet only through
    the store and the directory) serve multi-turn conversations that share a system prompt. Per turn: the prefill
    worker's hit tokens, whether it replayed, its TTFT against a full recompute (a reference engine in this process,
    no reuse), the decode worker's reuse, and whether the P/D output equals the reference's. Then two nodes are
    killed with SIGKILL and the decode worker asked for every conversation's last turn again (the blocks are decoded
    around the dead nodes, the outputs do not change); they are restarted, one with its disk wiped, and the cluster
    repaired back to full redundancy; a summary.
``deepseek-v4``
    a DeepSeek-V4 checkpoint (v4-tiny) in this process on the same store: a conversation whose every turn reuses the
    earlier turns' compressed block KV and StateBlocks, its TTFT against a run without reuse, and the answers equal.
``http``
    a multi-turn chat over HTTP (``kvtier-engine serve`` with a prefill and a decode worker process, the ``openai``
    client): per turn the answer's text, the prompt tokens reused from the store, and the TTFT with reuse against
    the same turn with its prefix changed (nothing to reuse).

A part is a function of the shared :class:`Demo` returning an exit status (0: everything it showed held); a new
one is a function added to :data:`PARTS`.
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from kvtier.engine import Engine
from kvtier.engine.checkpoint import make_checkpoint
from kvtier.engine.worker import WorkerProcess
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.placement import Placement
from kvtier.tools.benchutil import free_port
from kvtier.transfer.fetcher import LocalFetcher

NEW_TOKENS = 16
# ``kvtier-directory`` in this interpreter; not ``-m kvtier.transfer.directory``, whose package imports the module
# before runpy runs it (a RuntimeWarning on the demo's first line)
DIRECTORY = [sys.executable, "-c", "import sys; from kvtier.transfer.directory import main; sys.exit(main())"]
LEGEND = """\
  prompt           tokens of the turn: the shared 1,536-token system prompt,
                   the earlier turns and answers, the user's new message
  prefill hit      prompt tokens the prefill worker took from the store
                   instead of computing them
  replay           yes: no StateBlock at the hit point, so the sliding layers'
                   state came from running the hit's last 128 tokens again
                   (approximate, docs/engine.md); no: from a StateBlock (exact)
  TTFT reuse       the prefill worker's time to first token: lookups,
                   fetches and the computed rest of the prompt
  TTFT recompute   the same prompt computed from scratch, no store, by a
                   reference engine in this process
  decode hit (+N)  prompt tokens the decode worker took from the store, and
                   the N it recomputed (at most the last block)
  match            the decode worker's 16 tokens equal the reference's
  Turn 0 of the first conversation has nothing to reuse: a full compute plus
  lookups that miss, so it is no faster than the reference; every later turn
  reuses at least the system prompt."""


def play(
    prefill: WorkerProcess, decode: WorkerProcess, reference: Engine, conversations: int, turns: int, console: Console
) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Serve the conversations; returns one record per turn and every conversation's last prompt."""
    rng = np.random.default_rng(7)
    vocab = reference.config.vocab_size
    table = Table(title="multi-turn conversations, prefill and decode workers meeting through the store")
    for col in (
        "conv",
        "turn",
        "prompt",
        "prefill hit",
        "replay",
        "TTFT reuse",
        "TTFT recompute",
        "decode hit",
        "match",
    ):
        table.add_column(col, justify="right")
    system = rng.integers(0, vocab, 1536).tolist()  # shared by every conversation
    reference.generate([system], 1, reuse=False)  # warm-up: first calls pay for lazy initialisation
    records, last = [], []
    for conv in range(conversations):
        prompt = list(system)
        for turn in range(turns):
            prompt += rng.integers(0, vocab, int(rng.integers(200, 500))).tolist()  # the user's new message
            rid = f"{conv}.{turn}"
            pre = prefill.ask({"id": rid, "prompt": prompt})
            out = decode.ask({"id": rid, "prompt": prompt, "max_new_tokens": NEW_TOKENS})
            for answer in (pre, out):
                if "error" in answer:
                    raise RuntimeError(f"worker: {answer['error']}")
            ref = reference.generate([prompt], NEW_TOKENS, reuse=False)[0]
            match = out["tokens"] == ref.tokens
            records.append({"prompt": len(prompt), **pre, "recompute_s": ref.ttft_s, "match": match, "decode": out})
            table.add_row(
                str(conv),
                str(turn),
                str(len(prompt)),
                str(pre["hit_tokens"]),
                "yes" if pre["replayed"] else "no",
                f"{pre['ttft_s'] * 1e3:.0f} ms",
                f"{ref.ttft_s * 1e3:.0f} ms",
                f"{out['hit_tokens']} (+{out['recomputed_tokens']})",
                "[green]yes[/]" if match else "[red]NO[/]",
            )
            prompt += out["tokens"]  # the answer is part of the next turn's prompt
        last.append(prompt[: -len(out["tokens"])])
    console.print(table)
    console.print(LEGEND, style="dim", highlight=False, soft_wrap=True)
    return records, last


@dataclass
class Demo:
    """What every part shares: the running cluster, fetcher and StateBlock directory, the checkpoint, the options,
    and the step counter (:meth:`step` numbers the lines that say what happened)."""

    console: Console
    args: argparse.Namespace
    local: LocalCluster
    cluster: Path  # the cluster file
    checkpoint: Path
    fetcher: LocalFetcher
    directory: str  # the StateBlock directory's address
    steps: int = 0

    def step(self, text: str) -> None:
        self.steps += 1
        self.console.print(f"[bold]{self.steps}.[/] {text}")


@contextlib.contextmanager
def setup(args: argparse.Namespace, console: Console) -> Iterator[Demo]:
    """The cluster, the fetcher, the directory and the checkpoint, for as long as the parts run; all stopped after."""
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        directory = Path(args.dir or tmp)
        path = cluster_mod.write_default(directory, nodes=12, capacity_bytes=256 << 20)
        checkpoint = make_checkpoint(directory / "tiny", "tiny", seed=0)
        shm = f"kvtier-demo-{secrets.token_hex(4)}"
        page_bytes = Engine.from_pretrained(checkpoint, cache_tokens=64).cache.page_bytes  # the fetcher's slot: a block
        with (
            LocalCluster(path) as local,
            LocalFetcher(path, shm, directory / "fetcher.sock", "64MiB", f"{page_bytes}B") as fetcher,
        ):
            with open(directory / "directory.log", "ab") as log:  # its log lines are not the demo's output
                state_dir = WorkerProcess([*DIRECTORY, "--config", str(path), "--listen", "127.0.0.1:0"], stderr=log)
            try:
                state_dir.wait_ready()
                demo = Demo(console, args, local, path, checkpoint, fetcher, state_dir.ready.split()[1])
                demo.step(
                    f"12 node processes (RS 10+2), the fetcher ({shm}), the StateBlock directory, "
                    f"a tiny hybrid checkpoint (2 sliding + 2 global layers, window 128) in {checkpoint}"
                )
                yield demo
            finally:
                state_dir.proc.terminate()
                state_dir.stop()


def workers(demo: Demo) -> int:
    """Prefill and decode worker processes serving conversations, two nodes killed, repair, a summary."""
    common = ["--checkpoint", str(demo.checkpoint), "--store", str(demo.cluster)]
    common += ["--fetcher", str(demo.fetcher.socket_path), "--directory", demo.directory]
    pair = [WorkerProcess.engine(role, *common) for role in ("prefill", "decode")]
    try:
        for w in pair:  # the first request pays one-time costs (torch's first calls): not in the table
            w.wait_ready().ask({"id": "warm-up", "prompt": list(range(200)), "max_new_tokens": 1})
        demo.step(f"{demo.args.conversations} conversations × {demo.args.turns} turns")
        reference = Engine.from_pretrained(demo.checkpoint, store=demo.cluster)  # for its namespace; never reuses
        records, last = play(*pair, reference, demo.args.conversations, demo.args.turns, demo.console)
        status = resilience(demo, pair[1], reference, last)
        summary(demo, records)
        return status if all(r["match"] for r in records) else 1
    finally:
        for w in pair:  # their CPU goes to the next part
            w.stop()


def chat_over_http(demo: Demo, turns: int = 3) -> int:
    """Serve a chat over HTTP through a prefill and a decode worker process; print each turn."""
    import openai

    port = free_port()
    argv = [sys.executable, "-m", "kvtier.serving.cli", "serve", "--checkpoint", str(demo.checkpoint), "--store",
            str(demo.cluster), "--directory", demo.directory, "--prefill", "1", "--decode", "1", "--port", str(port),
            "--model", "tiny"]  # fmt: skip
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                demo.console.print("[red]the server did not start[/]")
                return 1
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="demo", max_retries=0, timeout=300)
        demo.step(f"a chat over HTTP ({url}/v1/chat/completions), prefill and decode worker processes")
        table = Table()
        for col in ("turn", "prompt", "cached", "TTFT reuse", "TTFT fresh prefix", "answer (random weights)"):
            table.add_column(col, justify="left" if col.startswith("answer") else "right")
        system = "You are the kvtier demo. " * 150  # a long shared system prompt (~2,000 tokens)
        messages = [{"role": "system", "content": system}]
        questions = ["What does the store keep?", "And when two nodes die?", "How is the cache shared?"]
        for turn, question in enumerate(questions[:turns]):
            messages.append({"role": "user", "content": question})
            warm, text, usage = _chat_ttft(client, messages)
            salted = [{"role": "system", "content": f"[{secrets.token_hex(4)}] " + system}, *messages[1:]]
            cold, _, cold_usage = _chat_ttft(client, salted)
            reused, fresh = usage.prompt_tokens_details.cached_tokens, cold_usage.prompt_tokens_details.cached_tokens
            row = [str(turn), str(usage.prompt_tokens), str(reused), f"{warm * 1e3:.0f} ms"]
            table.add_row(*row, f"{cold * 1e3:.0f} ms ({fresh} cached)", repr(text[:40]))
            messages.append({"role": "assistant", "content": text})
        demo.console.print(table)
        return 0
    finally:
        server.terminate()
        server.wait(timeout=60)


def deepseek_v4(demo: Demo, turns: int = 3) -> int:
    """A DeepSeek-V4 checkpoint on the same store: its block KV is the compressed branches (CSA entries and indexer
    keys, HCA entries), its StateBlocks the windows and the compressors' accumulators; per turn of a conversation the
    reuse, the TTFT and whether the answer equals a run without reuse."""
    checkpoint = make_checkpoint(demo.checkpoint.parent / "v4-tiny", "v4-tiny", seed=0)
    rng = np.random.default_rng(11)
    table = Table(title="DeepSeek-V4 (v4-tiny: CSA + HCA + sliding layers, hyper-connections, MoE) on the same store")
    for col in ("turn", "prompt", "hit", "replay", "TTFT reuse", "TTFT recompute", "match"):
        table.add_column(col, justify="right")
    with (
        Engine.from_pretrained(checkpoint, store=demo.cluster) as engine,
        Engine.from_pretrained(demo.checkpoint, cache_tokens=64) as dense,
    ):
        v4_bytes = engine.cache.page_bytes / engine.block_tokens
        dense_bytes = dense.cache.page_bytes / dense.block_tokens
        demo.step(
            f"a DeepSeek-V4 checkpoint ({checkpoint}): {engine.block_tokens}-token blocks of "
            f"{engine.cache.page_bytes:,} B ({v4_bytes:.0f} B a token, the dense tiny's {dense_bytes:.0f}), "
            f"StateBlocks of {engine.state_bytes:,} B"
        )
        prompt = rng.integers(0, engine.config.vocab_size, 1024).tolist()
        engine.generate([prompt[:256]], 1, reuse=False)  # warm-up: first calls pay for lazy initialisation
        matches = 0
        for turn in range(turns):
            prompt += rng.integers(0, engine.config.vocab_size, int(rng.integers(150, 300))).tolist()
            warm = engine.generate([prompt], NEW_TOKENS)[0]
            cold = engine.generate([prompt], NEW_TOKENS, reuse=False)[0]
            matches += warm.tokens == cold.tokens
            table.add_row(
                str(turn),
                str(len(prompt)),
                str(warm.hit_tokens),
                "yes" if warm.replayed else "no",
                f"{warm.ttft_s * 1e3:.0f} ms",
                f"{cold.ttft_s * 1e3:.0f} ms",
                "[green]yes[/]" if warm.tokens == cold.tokens else "[red]NO[/]",
            )
            prompt += warm.tokens
    demo.console.print(table)
    return 0 if matches == turns else 1


# the demo's parts, in the order they run: name -> the function that shows it
PARTS: dict[str, Callable[[Demo], int]] = {"workers": workers, "deepseek-v4": deepseek_v4, "http": chat_over_http}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvtier end-to-end demo: store, fetcher, directory, P/D workers")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"which parts to run, in order (of {', '.join(PARTS)})"
    )
    parser.add_argument("--dir", help="keep the cluster here instead of a temporary directory")
    args = parser.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        parser.error(f"no part named {', '.join(unknown)} (the parts: {', '.join(PARTS)})")
    console = Console()
    torch.set_num_threads(1)
    status = 0
    with setup(args, console) as demo:
        for name in parts:
            status |= PARTS[name](demo)
    return status


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def _chat_ttft(client: Any, messages: list[dict[str, str]]) -> tuple[float, str, Any]:
    """One streamed chat turn (greedy, 24 tokens): time to the first chunk with text, the text, the usage."""
    start = time.perf_counter()
    first, parts, usage = None, [], None
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    return (first or time.perf_counter()) - start, "".join(parts), usage


def resilience(demo: Demo, decode: WorkerProcess, reference: Engine, prompts: list[list[int]]) -> int:
    """Kill two nodes, decode again (degraded reads), restart one with a wiped disk and repair."""
    local = demo.local
    store = reference.store
    assert store is not None
    keys = [k for p in prompts for k in store.keys(p)]
    victims = sorted(int(n) for n in np.unique(Placement(local.config.groups).primaries(keys))[:2])
    for nid in victims:
        local.kill(nid)
    same = 0
    for i, prompt in enumerate(prompts):
        out = decode.ask({"id": f"again.{i}", "prompt": prompt, "max_new_tokens": NEW_TOKENS})
        same += out.get("tokens") == reference.generate([prompt], NEW_TOKENS, reuse=False)[0].tokens
    demo.step(
        f"killed nodes {victims} (primaries of stored blocks) with SIGKILL; decoded every last turn "
        f"again: {same}/{len(prompts)} outputs unchanged, blocks decoded around the dead nodes"
    )
    shutil.rmtree(local.config.nodes[victims[0]].data_dir / "slabs")  # as if its disk had died
    shutil.rmtree(local.config.nodes[victims[0]].data_dir / "meta")
    local.start(victims)
    time.sleep(local.config.client.retry_down_after_s)  # the client's back-off on nodes it saw down
    missing = int((~store.client.probe(keys)).sum())
    store.client.admin("gc", repair=True)
    demo.step(
        f"restarted both, node {victims[0]} with an empty disk: {missing} shards missing; "
        f"repair rewrote them, now {int((~store.client.probe(keys)).sum())} missing"
    )
    return 0 if same == len(prompts) else 1


def summary(demo: Demo, records: list[dict[str, Any]]) -> None:
    prompt_tokens = sum(r["prompt"] for r in records)
    hits = sum(r["hit_tokens"] for r in records)
    reused = [r for r in records if r["hit_tokens"]]
    speedups = [r["recompute_s"] / r["ttft_s"] for r in reused]
    demo.step("summary")
    demo.console.print(
        f"   prefill reused {hits} of {prompt_tokens} prompt tokens ({hits / prompt_tokens:.0%}); "
        f"TTFT with reuse {statistics.median(speedups) if speedups else float('nan'):.1f}× faster (median over "
        f"{len(reused)} turns with a hit); decode recomputed at most "
        f"{max(r['decode']['recomputed_tokens'] for r in records)} tokens a turn; "
        f"P/D outputs equal the single-process reference in {sum(r['match'] for r in records)}/{len(records)} turns"
    )


if __name__ == "__main__":
    raise SystemExit(main())
