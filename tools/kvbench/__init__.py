"""``kvbench``: kvtier's benchmark tool. Put/get throughput and latency against a real cluster, optionally next to
Redis and Mooncake Store on the same machine, every figure also as a ratio to one raw loopback TCP stream of the
same bytes measured in the same run; and ``replay`` of request traces.

    kvbench [--config PATH] putget [--block-size SIZE] [--concurrency N] [--duration S] [--batch-bytes SIZE]
                                   [--max-bytes SIZE] [--fresh] [--vs-redis] [--vs-mooncake] [--degraded K]
                                   [--json]
    kvbench replay TRACE [replay options]          (see ``kvbench replay --help``)
    kvbench adapter [--engines sglang,vllm,lmcache]  (pages through each engine adapter vs the raw client)
    kvbench route TRACE --prefill N --decode M     (routing over prefill/decode pools, simulated)
    kvbench fit-cost [--out cost.json]             (the step cost model t(q, c) the balancers use)
    kvbench decode [--concurrency 1,8,32,64]       (batched decode: tokens/s, ITL, the step's memory roofline)
    kvbench kv-bytes [--models 8b,v4-flash]        (block and StateBlock bytes per token of model shapes)
    kvbench kv-format [--format seed]              (accuracy of reuse from low-precision KV formats)

One module per subcommand (``tools/kvbench/putget.py``, ``replay.py``, ...), each with ``register``
(``tools.cliutil.Subcommands``); this entry point lists them in :data:`SUBCOMMANDS` and maps their errors to
exit statuses: 0 done; 1 a run that failed (``kvbench: ...``; a read that came back wrong or missing is
``kvbench: DATA MISMATCH: ...``); 2 a usage error, one ``kvbench: error: ...`` line on stderr.
"""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence

from kvtier.tools.cliutil import Parser, Subcommands, report_errors
from kvtier.tools.kvbench import (
    adapter,
    decode,
    fetch,
    fitcost,
    kvbytes,
    kvformat,
    putget,
    replay,
    route,
    stateblock,
    swa_replay,
    swapin,
    ttft,
)
from kvtier.tools.kvbench.common import PROG, BenchError, UsageError, VerifyError

# a new subcommand: its module, plus one entry here
SUBCOMMANDS = (
    putget, replay, fetch, stateblock, ttft, swa_replay, swapin, adapter, fitcost, route, kvbytes, kvformat, decode,
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--token-file", metavar="PATH", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    parser = Parser(prog=PROG, description="kvtier benchmarks: put/get against a cluster, and trace replay.")
    parser.add_argument("--config", metavar="PATH", help="cluster file of a running cluster (default: a temporary one)")
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help="file holding the token (mode 0600; default $KVTIER_TOKEN, else --config's)",
    )
    commands = Subcommands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"), common)
    for module in SUBCOMMANDS:
        module.register(commands)
    return parser


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # stop nodes and servers on the way out, as Ctrl-C does
    errors = [(UsageError, 2, "error: "), (VerifyError, 1, "DATA MISMATCH: "), (BenchError, 1, "")]
    return report_errors(PROG, lambda: args.run(args), errors)
