"""``kvbench swa-replay``: how far bounded replay of the sliding-window state is from exact, on a fixed prompt set.

    kvbench [--config PATH] swa-replay [--checkpoint DIR | --preset tiny] [--prompts 8] [--new-tokens 32] [--json]

For each prompt (seeded; lengths spread over 600 … 3,000 tokens): one engine computes and stores its first
``h`` tokens' blocks (``h`` ≈ 80 % of it), then a second engine that shares the store but **not** the StateBlocks
prefills the whole prompt: block KV is there, the StateBlock is not, so it replays positions ``h-W … h-1``. Its
output is compared with a run without reuse: max |Δlogit| of the first token, and greedy agreement over
``--new-tokens`` (positions equal, and the length of the common prefix).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import numpy as np

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import BenchError, UsageError
from kvtier.tools.kvbench.enginebench import add_model_arguments, checkpoint_and_cluster, describe


def register(commands: Subcommands) -> None:
    p = commands.add("swa-replay", "error of bounded SWA replay against exact prefill", run)
    p.add_argument("--prompts", type=int, default=8, help="prompts in the fixed set (default 8)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared (default 32)")
    add_model_arguments(p)


def run(args: argparse.Namespace) -> int:
    if min(args.prompts, args.new_tokens, args.threads) < 1:
        raise UsageError("--prompts, --new-tokens and --threads must be at least 1")
    from kvtier.engine.engine import Engine
    from kvtier.engine.stateblocks import LocalStateBlocks

    with checkpoint_and_cluster(args, "kvbench-swa-") as (checkpoint, config, _):
        producer = Engine.from_pretrained(checkpoint, store=config, state_blocks=LocalStateBlocks())
        rows = []
        for i, length in enumerate(np.linspace(600, 3000, args.prompts).astype(int).tolist()):
            prompt = np.random.default_rng(i).integers(0, producer.config.vocab_size, length).tolist()
            producer.generate([prompt[: int(length * 0.8)]], 1)
            consumer = Engine.from_pretrained(checkpoint, store=config, state_blocks=LocalStateBlocks())
            replayed = consumer.generate([prompt], args.new_tokens)[0]
            exact = consumer.generate([prompt], args.new_tokens, reuse=False)[0]
            if not replayed.replayed:
                raise BenchError(f"prompt {i}: expected a replayed hit, got hit {replayed.hit_tokens}")
            same = [a == b for a, b in zip(replayed.tokens, exact.tokens, strict=True)]
            rows.append(
                {
                    "prompt_tokens": length,
                    "hit_tokens": replayed.hit_tokens,
                    "max_abs_dlogit": (replayed.first_logits - exact.first_logits).abs().max().item(),
                    "tokens_equal": sum(same),
                    "common_prefix": same.index(False) if False in same else len(same),
                }
            )
    result = {
        "command": "swa-replay",
        "settings": {
            "checkpoint": describe(args),
            "new_tokens": args.new_tokens,
        },
        "prompts": rows,
        "max_abs_dlogit_max": max(r["max_abs_dlogit"] for r in rows),
        "max_abs_dlogit_median": statistics.median(r["max_abs_dlogit"] for r in rows),
        "token_agreement": sum(r["tokens_equal"] for r in rows) / (len(rows) * args.new_tokens),
    }
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0


def _text(result: dict[str, Any]) -> str:
    n = result["settings"]["new_tokens"]
    lines = [
        f"bounded SWA replay vs exact, {result['settings']['checkpoint']}, {n} greedy tokens",
        f"{'prompt':>7} {'hit':>6} {'max|Δlogit|':>12} {'equal':>7} {'common prefix':>14}",
    ]
    for r in result["prompts"]:
        lines.append(
            f"{r['prompt_tokens']:>7} {r['hit_tokens']:>6} {r['max_abs_dlogit']:>12.4f} "
            f"{r['tokens_equal']:>4}/{n:<2} {r['common_prefix']:>14}"
        )
    lines.append(
        f"max |Δlogit|: max {result['max_abs_dlogit_max']:.4f}, median {result['max_abs_dlogit_median']:.4f}; "
        f"greedy agreement {result['token_agreement']:.1%}"
    )
    return "\n".join(lines)
