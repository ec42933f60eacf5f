"""``kvbench route``: the prefill and decode balancers against round-robin and least-loaded routing, simulated.

    kvbench route TRACE --prefill N --decode M [--policy deepinfer|round-robin|least-loaded|all]
                  [--cost-model FILE] [--capacity-tokens N] [--ttft-slo S] [--tbt-slo S] [--step-budget-ms MS]
                  [--window-s S] [--bucket-edges A,B,C] [--json]

A discrete-event simulation over a Mooncake-format trace (``tools.route_sim`` states the model): the fitted
cost model (``kvbench fit-cost``; default: an 8 B model on an H200) prices every prefill chunk and decode step,
the store's hit ratio from ``replay`` sets each request's cached prefix. Reports TTFT and TBT percentiles,
goodput under the SLOs, and each pool's balance against an offline optimum with hindsight.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import UsageError


def register(commands: Subcommands) -> None:
    from kvtier.tools.route_sim import POLICIES

    p = commands.add("route", "simulate routing a trace over prefill and decode pools", run)
    p.add_argument("trace", help="Mooncake-format JSONL trace")
    p.add_argument("--prefill", type=int, required=True, help="prefill engines")
    p.add_argument("--decode", type=int, required=True, help="decode replicas")
    p.add_argument("--policy", choices=[*POLICIES, "all"], default="all", help="routing policy (default: all)")
    p.add_argument("--cost-model", help="t(q, c) and d(n, kv) from `kvbench fit-cost` (default: 8 B on an H200)")
    p.add_argument("--capacity-tokens", type=int, help="store capacity for the hit ratio (default: infinite)")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash id (default 512)")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT target, seconds (default 2)")
    p.add_argument("--tbt-slo", type=float, default=0.05, help="time-between-tokens target, seconds (default 0.05)")
    p.add_argument("--step-budget-ms", type=float, default=200.0, help="prefill step budget (default 200)")
    p.add_argument("--window-s", type=float, default=10.0, help="balancer and balance-measurement window (10)")
    p.add_argument("--bucket-edges", default="16384,65536,262144", help="context-length bucket edges")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvtier.serving.cost import CostModel
    from kvtier.tools.route_sim import H200_8B, POLICIES, simulate
    from kvtier.tools.traces import TraceError, load_trace

    if args.prefill < 1 or args.decode < 1:
        raise UsageError("--prefill and --decode must be at least 1")
    if min(args.ttft_slo, args.tbt_slo, args.step_budget_ms, args.window_s) <= 0:
        raise UsageError("--ttft-slo, --tbt-slo, --step-budget-ms and --window-s must be positive")
    try:
        edges = tuple(int(e) for e in args.bucket_edges.split(","))
        cost = CostModel.load(args.cost_model) if args.cost_model else H200_8B
        trace = load_trace(args.trace)
    except (OSError, ValueError, TraceError) as e:
        raise UsageError(str(e)) from None
    if not trace:
        raise UsageError(f"{args.trace} has no requests")
    policies = POLICIES if args.policy == "all" else (args.policy,)
    results = {}
    for policy in policies:
        results[policy] = simulate(
            trace, args.prefill, args.decode, policy, cost,
            block_tokens=args.block_tokens, capacity_tokens=args.capacity_tokens,
            step_budget_s=args.step_budget_ms / 1e3, window_s=args.window_s, edges=edges,
            ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
        )  # fmt: skip
    settings = {"trace": args.trace, "prefill": args.prefill, "decode": args.decode, "ttft_slo_s": args.ttft_slo,
                "tbt_slo_s": args.tbt_slo, "cost_model": args.cost_model or "8b-h200"}  # fmt: skip
    out = {"command": "route", "settings": settings, "policies": results}
    print(json.dumps(out, indent=2) if args.json else _text(out))
    return 0


def _text(out: dict[str, Any]) -> str:
    s = out["settings"]
    lines = [
        f"{s['trace']}: {s['prefill']} prefill + {s['decode']} decode, SLO TTFT {s['ttft_slo_s']} s / "
        f"TBT {s['tbt_slo_s'] * 1e3:.0f} ms, cost model {s['cost_model']}",
        f"{'policy':<13} {'TTFT p50':>9} {'p99':>8} {'TBT p50':>8} {'p99':>7} {'goodput':>9} {'in SLO':>7} "
        f"{'prefill bal':>11} {'decode bal':>10}",
    ]
    for policy, r in out["policies"].items():
        balance = (r["prefill_balance"]["vs_lpt"], r["decode_balance"]["vs_lpt"])
        lines.append(
            f"{policy:<13} {r['ttft_s']['p50']:>8.2f}s {r['ttft_s']['p99']:>7.2f}s "
            f"{r['tbt_s']['p50'] * 1e3:>6.1f}ms {r['tbt_s']['p99'] * 1e3:>5.1f}ms {r['goodput_rps']:>6.2f}/s "
            f"{r['slo_attainment']:>7.1%} {balance[0]:>11.1%} {balance[1]:>10.1%}"
        )
    lines.append("balance: Σ offline optimum (longest-first, hindsight) / Σ the policy's max, per window or sample")
    return "\n".join(lines)
