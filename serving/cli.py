"""``kvtier-engine``: the engine's commands (``kvtier.engine.cli``) plus ``serve``, the OpenAI-compatible server.

    kvtier-engine serve --checkpoint DIR --store cluster.toml [--prefill N --decode M] [--host H --port P]

With ``--prefill 0 --decode 0`` (the default) the engine runs inside the server process (embedded). Otherwise
the server starts and supervises N prefill and M decode worker processes (``kvtier-engine prefill|decode`` with
the step budget and cost model below) and, unless ``--directory`` names one, a StateBlock directory for them to
meet through. ``GET /health`` answers 503 until the model is loaded and every pool has a worker up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.engine import cli as engine_cli
from kvtier.engine import worker
from kvtier.engine.worker import ChunkPlanner, WorkerProcess
from kvtier.serving.cost import CostModel
from kvtier.serving.prefill_balance import DEFAULT_EDGES
from kvtier.serving.server import Limits, Server
from kvtier.serving.text import TextCodec
from kvtier.serving.workers import ProcessWorker, ThreadWorker, Worker


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost-model", help="fitted t(q, c) (JSON from `kvbench fit-cost`): per-step prefill chunks")
    p.add_argument("--step-budget-ms", type=float, default=200.0, help="time budget of one engine step (default 200)")


def planner(args: argparse.Namespace, granule: int = 512) -> ChunkPlanner | None:
    """The per-step chunk planner from ``--cost-model`` (None without one: prompts are computed whole)."""
    if not args.cost_model:
        return None
    cost = CostModel.load(args.cost_model)
    return lambda left, cached, time_left_s: cost.largest_chunk(left, cached, time_left_s, granule)


def _run_worker(role: str, args: argparse.Namespace) -> None:
    worker.serve(role, args, plan_chunk=planner(args), step_budget_s=args.step_budget_ms / 1e3)


def build_parser() -> argparse.ArgumentParser:
    top, sub = engine_cli.parsers()
    for role in ("prefill", "decode"):
        add_budget_arguments(sub.choices[role])
        sub.choices[role].set_defaults(run=lambda args, role=role: _run_worker(role, args))
    s = sub.add_parser("serve", help="the OpenAI-compatible server (embedded engine, or prefill/decode pools)")
    worker.add_arguments(s)
    add_budget_arguments(s)
    s.add_argument("--prefill", type=int, default=0, help="prefill worker processes (0 with --decode 0: embedded)")
    s.add_argument("--decode", type=int, default=0, help="decode worker processes")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--model", help="the model's name in the API (default: the checkpoint directory's name)")
    s.add_argument(
        "--max-queued-requests",
        type=int,
        default=Limits.max_queued_requests,
        help="requests waiting for their first token before new ones get 429",
    )
    s.add_argument(
        "--max-queued-tokens",
        type=int,
        default=Limits.max_queued_tokens,
        help="prompt tokens waiting for their first token before new ones get 429",
    )
    s.add_argument("--window-s", type=float, default=10.0, help="prefill balancer's demand window (default 10 s)")
    s.add_argument("--bucket-edges", default=",".join(map(str, DEFAULT_EDGES)), help="context-length bucket edges")
    s.add_argument(
        "--tbt-slo-ms",
        type=float,
        help="time between tokens to keep decode replicas within (the decode balancer's rule 3; needs --cost-model)",
    )
    s.set_defaults(run=serve)
    return top


def make_server(args: argparse.Namespace) -> tuple[Server, list[WorkerProcess]]:
    """The server and its workers (not started) from ``serve``'s arguments, and the helper processes it
    started (the StateBlock directory). ValueError (one line) for bad arguments."""
    if args.prefill < 0 or args.decode < 0 or bool(args.prefill) != bool(args.decode):
        raise ValueError("--prefill and --decode are both 0 (embedded) or both at least 1")
    if args.max_queued_requests < 1 or args.max_queued_tokens < 1:
        raise ValueError("--max-queued-requests and --max-queued-tokens must be at least 1")
    if args.tbt_slo_ms is not None and (args.tbt_slo_ms <= 0 or not args.cost_model):
        raise ValueError("--tbt-slo-ms must be a positive number of milliseconds, with --cost-model")
    edges = tuple(int(e) for e in args.bucket_edges.split(","))
    if list(edges) != sorted(set(edges)) or edges[0] <= 0:
        raise ValueError(f"--bucket-edges must be increasing positive token counts, got {args.bucket_edges}")
    checkpoint = Path(args.checkpoint)
    codec = TextCodec(checkpoint)
    config = json.loads((checkpoint / "config.json").read_text())
    cost = CostModel.load(args.cost_model) if args.cost_model else None
    limits = Limits(args.max_queued_requests, args.max_queued_tokens)
    tbt_slo_s = args.tbt_slo_ms / 1e3 if args.tbt_slo_ms is not None else None
    common = {"cost": cost, "limits": limits, "window_s": args.window_s, "edges": edges, "tbt_slo_s": tbt_slo_s}
    name = args.model or checkpoint.resolve().name
    context, vocab = int(config["max_position_embeddings"]), int(config["vocab_size"])
    helpers: list[WorkerProcess] = []
    if not args.prefill:
        engine = ThreadWorker(lambda: worker.open_engine("both", args), planner(args), args.step_budget_ms / 1e3)
        return Server(codec, name, context, vocab, both=[engine], **common), helpers
    directory = args.directory
    if directory is None:
        run = "import sys; from kvtier.transfer.directory import main; sys.exit(main(sys.argv[1:]))"
        argv = [sys.executable, "-c", run, "--config", args.store, "--listen", "127.0.0.1:0"]
        helpers.append(WorkerProcess(argv, with_parent=True).wait_ready())  # (it never reads its stdin)
        directory = helpers[-1].ready.split()[1]
    flags = ["--checkpoint", str(checkpoint), "--store", args.store, "--directory", directory]
    flags += ["--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
    flags += ["--step-budget-ms", str(args.step_budget_ms), "--cache-tokens", str(args.cache_tokens)]
    flags += ["--fetcher", args.fetcher] if args.fetcher else []
    flags += ["--cost-model", args.cost_model] if args.cost_model else []
    pools: dict[str, list[Worker]] = {}
    for role, n in (("prefill", args.prefill), ("decode", args.decode)):
        argv = [sys.executable, "-m", "kvtier.serving.cli", role, *flags]
        pools[role] = [ProcessWorker(role, f"{role}-{i}", argv) for i in range(n)]
    return Server(codec, name, context, vocab, prefill=pools["prefill"], decode=pools["decode"], **common), helpers


def serve(args: argparse.Namespace) -> None:
    server, helpers = make_server(args)
    try:
        asyncio.run(_serve(server, args.host, args.port))
    finally:
        for helper in helpers:  # the StateBlock directory: nothing to finish, it goes at once
            helper.proc.terminate()
            helper.proc.wait()


async def _serve(server: Server, host: str, port: int) -> None:
    import uvicorn  # the `serve` extra

    from kvtier.serving.app import build_app

    config = uvicorn.Config(build_app(server), host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
    web = uvicorn.Server(config)
    await server.start()
    print(f"kvtier-engine: serving {server.model} at http://{host}:{port}/v1 ({server.ready()[1]})", flush=True)
    try:
        await web.serve()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(None, server.stop)


def main(argv: Sequence[str] | None = None) -> int:
    return engine_cli.main(argv, build_parser)


if __name__ == "__main__":
    sys.exit(main())
