"""``kvtier-engine``: the engine's commands (``kvtier.engine.cli``) plus ``serve``, the OpenAI-compatible server.

    kvtier-engine serve --checkpoint DIR --store cluster.toml [--prefill N --decode M] [--host H --port P]

With ``--prefill 0 --decode 0`` (the default) the engine runs inside the server process (embedded, on a thread).
Otherwise the server starts and supervises N prefill and M decode worker processes (``kvtier-engine prefill|decode``
with every worker option ``serve`` was given: ``worker.flags``) and, unless ``--directory`` names one, a StateBlock
directory for them to meet through, serving this tenant only. ``GET /health`` answers 503 until the model is loaded
and every worker is up (and while one is down); requests get 503 only while a pool has no worker up.

The server binds its port before it says ``serving at``; it prints ``ready`` once every worker is. SIGTERM (or
Ctrl-C) stops it gracefully: no new connections, answers running get ``--shutdown-grace-s`` to finish, then streams
end with an error event and ``[DONE]`` and whole answers get a 503; then the workers stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path

from kvtier.engine import cli as engine_cli
from kvtier.engine import worker
from kvtier.engine.worker import WorkerProcess
from kvtier.serving.app import MAX_REQUEST_BYTES, build_app
from kvtier.serving.cost import CostModel
from kvtier.serving.prefill_balance import DEFAULT_EDGES
from kvtier.serving.server import Limits, Server
from kvtier.serving.text import TextCodec
from kvtier.serving.workers import ProcessWorker, ThreadWorker, Worker

API_KEY_ENV = "KVTIER_API_KEY"


def add_budget_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost-model", help="fitted t(q, c) (JSON from `kvbench fit-cost`): per-step prefill chunks")
    p.add_argument("--step-budget-ms", type=float, default=200.0, help="time budget of one engine step (default 200)")


def cost_model(args: argparse.Namespace) -> CostModel | None:
    """``--cost-model``'s model, which sizes each step's prefill chunks (None without one: prompts are computed
    whole); ValueError naming the option for a file that is missing or not one."""
    if not args.cost_model:
        return None
    try:
        return CostModel.load(args.cost_model)
    except OSError as e:
        raise ValueError(f"--cost-model {args.cost_model}: {e.strerror} (kvbench fit-cost writes one)") from None
    except ValueError as e:
        raise ValueError(f"--cost-model {e}") from None


def _run_worker(role: str, args: argparse.Namespace) -> None:
    worker.serve(role, args, cost=cost_model(args), step_budget_s=args.step_budget_ms / 1e3)


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
    s.add_argument(
        "--served-model-name",
        "--model",
        nargs="+",
        dest="served_model_name",
        help="the model's names in the API: the first is reported, any is accepted (default: the directory's name)",
    )
    s.add_argument("--max-model-len", type=int, help="context in tokens (default and most: the checkpoint's)")
    s.add_argument(
        "--chat-template", help="a chat template (jinja2), or a file holding one, instead of the checkpoint's"
    )
    s.add_argument("--api-key", help=f"the key clients must send (Authorization: Bearer KEY); default ${API_KEY_ENV}")
    s.add_argument(
        "--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, help="largest request body (default 32 MiB)"
    )
    s.add_argument(
        "--shutdown-grace-s", type=float, default=10.0, help="on SIGTERM, how long answers may run on (default 10)"
    )
    s.add_argument("--disable-access-log", action="store_true", help="no log line per request")
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


def worker_argv(role: str, args: argparse.Namespace, directory: str) -> list[str]:
    """The command of a ``role`` worker process for ``serve``'s ``args``: every worker option (``worker.flags``),
    the step budget, and the StateBlock directory they meet through."""
    options = argparse.Namespace(**{**vars(args), "directory": directory})
    return [sys.executable, "-m", "kvtier.serving.cli", role, *worker.flags(options, worker.add_arguments,
                                                                            add_budget_arguments)]  # fmt: skip


def make_server(args: argparse.Namespace) -> tuple[Server, list[WorkerProcess]]:
    """The server and its workers (not started) from ``serve``'s arguments, and the helper processes it
    started (the StateBlock directory). ValueError (one line) for bad arguments, a ``--kv-format`` the model cannot
    take among them, before anything starts."""
    if args.prefill < 0 or args.decode < 0 or bool(args.prefill) != bool(args.decode):
        raise ValueError("--prefill and --decode are both 0 (embedded) or both at least 1")
    if args.max_queued_requests < 1 or args.max_queued_tokens < 1:
        raise ValueError("--max-queued-requests and --max-queued-tokens must be at least 1")
    if args.tbt_slo_ms is not None and (args.tbt_slo_ms <= 0 or not args.cost_model):
        raise ValueError("--tbt-slo-ms must be a positive number of milliseconds, with --cost-model")
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError("--max-num-seqs must be at least 1")
    worker.check_kv_format(args)  # (a worker refused its format would exit and be restarted, again and again)
    edges = tuple(int(e) for e in args.bucket_edges.split(","))
    if list(edges) != sorted(set(edges)) or edges[0] <= 0:
        raise ValueError(f"--bucket-edges must be increasing positive token counts, got {args.bucket_edges}")
    checkpoint = Path(args.checkpoint)
    codec = TextCodec(checkpoint, args.chat_template)
    config = json.loads((checkpoint / "config.json").read_text())
    context, vocab = int(config["max_position_embeddings"]), int(config["vocab_size"])
    if args.max_model_len is not None:
        if not 1 < args.max_model_len <= context:
            raise ValueError(f"--max-model-len must be in 2…{context} (the checkpoint's context)")
        context = args.max_model_len
    cost = cost_model(args)
    limits = Limits(args.max_queued_requests, args.max_queued_tokens, args.cache_tokens)
    tbt_slo_s = args.tbt_slo_ms / 1e3 if args.tbt_slo_ms is not None else None
    common = {"cost": cost, "limits": limits, "window_s": args.window_s, "edges": edges, "tbt_slo_s": tbt_slo_s}
    names = args.served_model_name or [checkpoint.resolve().name]
    helpers: list[WorkerProcess] = []
    if not args.prefill:
        engine = ThreadWorker(
            lambda: worker.open_engine("both", args),
            cost,
            args.step_budget_ms / 1e3,
            loop_options=worker.loop_options(args),
        )
        return Server(codec, names, context, vocab, both=[engine], **common), helpers
    directory = args.directory
    if directory is None:
        helpers.append(_start_directory(args))
        directory = helpers[-1].ready.split()[1]
    pools: dict[str, list[Worker]] = {}
    for role, n in (("prefill", args.prefill), ("decode", args.decode)):
        argv = worker_argv(role, args, directory)
        pools[role] = [ProcessWorker(role, f"{role}-{i}", argv) for i in range(n)]
    return Server(codec, names, context, vocab, prefill=pools["prefill"], decode=pools["decode"], **common), helpers


def _start_directory(args: argparse.Namespace) -> WorkerProcess:
    """A StateBlock directory for the workers, on a free local port, that knows the tenants the store file names:
    every tenant of a cluster file, or (a client file) the one of ``--token-file`` / ``$KVTIER_TOKEN``."""
    run = "import sys; from kvtier.serving.cli import run_directory; sys.exit(run_directory(sys.argv[1:]))"
    argv = [sys.executable, "-c", run, args.store, args.token_file or ""]
    return WorkerProcess(argv, with_parent=True).wait_ready()  # (it never reads its stdin)


def run_directory(argv: list[str]) -> int:
    """``_start_directory``'s process: ``STORE TOKEN_FILE`` (or '')."""
    import threading

    from kvtier.kvstore import logs
    from kvtier.kvstore.cluster import map as cluster_map
    from kvtier.kvstore.cluster.config import ConfigError, read_token_file
    from kvtier.transfer.directory import Directory
    from kvtier.transfer.directory import serve as serve_directory

    store, token_file = argv
    try:
        config = cluster_map.load_client(store, read_token_file(token_file) if token_file else None)
    except ConfigError as e:
        print(f"kvtier-engine: {e}", file=sys.stderr)
        return 2
    logs.configure(component="directory")
    listener = socket.create_server(("127.0.0.1", 0))
    print(f"ready 127.0.0.1:{listener.getsockname()[1]}", flush=True)
    serve_directory(config, listener, Directory(10.0), threading.Event())
    return 0


def serve(args: argparse.Namespace) -> None:
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if args.max_request_bytes < 1 or args.shutdown_grace_s < 0:
        raise ValueError("--max-request-bytes must be at least 1 and --shutdown-grace-s at least 0")
    try:
        listener = socket.create_server((args.host, args.port))
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}") from None
    _configure_logs(access=not args.disable_access_log)
    server, helpers = make_server(args)
    try:
        app = build_app(server, api_key, args.max_request_bytes)
        asyncio.run(_serve(server, app, listener, args.shutdown_grace_s))
    finally:
        for helper in helpers:  # the StateBlock directory: nothing to finish, it goes at once
            helper.proc.terminate()
            helper.proc.wait()


def _configure_logs(access: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    logging.getLogger("uvicorn").setLevel(logging.WARNING)
    logging.getLogger("kvtier.serving.access").disabled = not access


async def _serve(server: Server, app: object, listener: socket.socket, grace_s: float) -> None:
    import uvicorn  # the `serve` extra

    class Web(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            server.begin_shutdown(grace_s)  # the answers still running then are cut; uvicorn waits for them
            self._captured_signals.clear()  # a graceful stop: exit 0 (uvicorn would raise SIGTERM again at the end)
            await super().shutdown(sockets)

    # (log_config None: uvicorn's own would re-enable the access logger --disable-access-log turned off)
    config = uvicorn.Config(app, timeout_graceful_shutdown=int(grace_s) + 10, access_log=False, log_config=None)
    web = Web(config)
    await server.start()
    host, port = listener.getsockname()[:2]
    print(f"kvtier-engine: serving {server.model} at http://{host}:{port}/v1 ({server.ready()[1]})", flush=True)
    try:
        await web.serve(sockets=[listener])
    finally:
        with contextlib.suppress(Exception):
            await asyncio.get_running_loop().run_in_executor(None, server.stop)


def main(argv: Sequence[str] | None = None) -> int:
    return engine_cli.main(argv, build_parser)


if __name__ == "__main__":
    sys.exit(main())
