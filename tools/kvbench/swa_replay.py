"""``kvbench swa-replay``: how far bounded replay of the sliding-window state is from exact prefill, over a seeded
prompt set, as a distribution.

    kvbench [--config PATH] swa-replay [--checkpoint DIR | --preset tiny] [--seed 0] [--prompts 8]
                                       [--lengths 600-3000] [--new-tokens 32] [--json]

For each prompt (``--prompts`` of them, lengths spread evenly over ``--lengths``, tokens drawn from ``--seed``,
which also seeds the preset checkpoint): one engine computes and stores its first ``h`` tokens' blocks
(``h`` ≈ 80 % of it), then a second engine that shares the store but **not** the StateBlocks prefills the whole
prompt: block KV is there, the StateBlock is not, so it replays positions ``h-W … h-1``. Its output is compared
with a run without reuse:

- the error: max |Δlogit| of the first token (its distribution over the prompts: median, p90, max);
- how close the exact run was to a tie: the first token's top-2 margin, and how many prompts have a margin below
  twice their error (where the error can swap the top two: a **near tie**);
- greedy agreement over ``--new-tokens``: positions equal, the common prefix, the prompts that diverged, and for
  each the exact run's top-2 margin at the first position that differs.

Replay is approximate (the window's state is rebuilt from its last ``W`` tokens alone), so a greedy continuation
diverges wherever the exact logits' top two are closer than the error: agreement over a few prompts says little;
run many (``--prompts 40``, several seeds) and read the margins.
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

HIT_FRACTION = 0.8  # of each prompt stored by the first engine


def register(commands: Subcommands) -> None:
    p = commands.add("swa-replay", "error of bounded SWA replay against exact prefill", run)
    p.add_argument("--prompts", type=int, default=8, help="prompts in the set (default 8)")
    p.add_argument("--lengths", default="600-3000", metavar="MIN-MAX", help="prompt lengths, spread evenly (600-3000)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the preset checkpoint (default 0)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared (default 32)")
    add_model_arguments(p)


def _lengths(text: str, prompts: int) -> list[int]:
    low, sep, high = text.partition("-")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise UsageError(f"--lengths {text!r}: use MIN-MAX in tokens, e.g. 700-2500") from None
    if not 0 < lo <= hi:
        raise UsageError(f"--lengths {text!r}: need 0 < MIN <= MAX")
    return np.linspace(lo, hi, prompts).astype(int).tolist()


def _margin(logits: Any) -> float:
    """The gap between the largest and second largest logit."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def run(args: argparse.Namespace) -> int:
    if min(args.prompts, args.new_tokens, args.threads) < 1:
        raise UsageError("--prompts, --new-tokens and --threads must be at least 1")
    lengths = _lengths(args.lengths, args.prompts)
    from kvtier.engine import Engine
    from kvtier.engine.stateblocks import LocalStateBlocks

    with checkpoint_and_cluster(args, "kvbench-swa-", seed=args.seed) as (checkpoint, config, _):
        producer = Engine.from_pretrained(checkpoint, store=config, state_blocks=LocalStateBlocks())
        if producer.config.max_position_embeddings <= lengths[-1] + args.new_tokens:
            raise UsageError(f"--lengths {args.lengths}: the model takes {producer.config.max_position_embeddings}")
        rows = []
        for i, length in enumerate(lengths):
            prompt = np.random.default_rng((args.seed, i)).integers(0, producer.config.vocab_size, length).tolist()
            producer.generate([prompt[: int(length * HIT_FRACTION)]], 1)
            consumer = Engine.from_pretrained(checkpoint, store=config, state_blocks=LocalStateBlocks())
            replayed = consumer.generate([prompt], args.new_tokens)[0]
            exact = consumer.generate([prompt], args.new_tokens, reuse=False)[0]
            if not replayed.replayed:
                raise BenchError(f"prompt {i}: expected a replayed hit, got hit {replayed.hit_tokens}")
            same = [a == b for a, b in zip(replayed.tokens, exact.tokens, strict=True)]
            common = same.index(False) if False in same else len(same)
            error = (replayed.first_logits - exact.first_logits).abs().max().item()
            margin = _margin(exact.first_logits)
            rows.append(
                {
                    "prompt_tokens": length,
                    "hit_tokens": replayed.hit_tokens,
                    "max_abs_dlogit": error,
                    "top2_margin": margin,
                    "near_tie": margin < 2 * error,
                    "tokens_equal": sum(same),
                    "common_prefix": common,
                    # the exact run's top-2 margin where the two continuations part (None: they never do)
                    "margin_at_divergence": None
                    if common == len(same)
                    else _margin(consumer.logits(prompt + exact.tokens[:common])[-1]),
                }
            )
    print(json.dumps(summarize(rows, args), indent=2) if args.json else _text(summarize(rows, args)))
    return 0


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The per-prompt rows and their distribution (the JSON ``kvbench swa-replay --json`` prints)."""
    errors = sorted(r["max_abs_dlogit"] for r in rows)
    diverged = [r for r in rows if r["margin_at_divergence"] is not None]
    return {
        "command": "swa-replay",
        "settings": {
            "checkpoint": describe(args),
            "seed": args.seed,
            "prompts": len(rows),
            "lengths": args.lengths,
            "new_tokens": args.new_tokens,
        },
        "prompts": rows,
        "max_abs_dlogit_max": errors[-1],
        "max_abs_dlogit_median": statistics.median(errors),
        "max_abs_dlogit_p90": errors[min(len(errors) - 1, int(0.9 * len(errors)))],
        "top2_margin_min": min(r["top2_margin"] for r in rows),
        "near_ties": sum(r["near_tie"] for r in rows),
        "first_token_diverged": sum(r["common_prefix"] == 0 for r in rows),
        "diverged": len(diverged),
        "margin_at_divergence_max": max((r["margin_at_divergence"] for r in diverged), default=None),
        "token_agreement": sum(r["tokens_equal"] for r in rows) / (len(rows) * args.new_tokens),
    }


def _text(result: dict[str, Any]) -> str:
    s = result["settings"]
    n = s["new_tokens"]
    lines = [
        f"bounded SWA replay vs exact, {s['checkpoint']}, {s['prompts']} prompts of {s['lengths']} tokens drawn "
        f"from seed {s['seed']}, {n} greedy tokens",
        f"{'prompt':>7} {'hit':>6} {'max|Δlogit|':>12} {'top-2 margin':>13} {'equal':>7} {'common prefix':>14}",
    ]
    for r in result["prompts"]:
        tie = " near tie" if r["near_tie"] else ""
        parted = "" if r["margin_at_divergence"] is None else f" (margin there {r['margin_at_divergence']:.4f})"
        lines.append(
            f"{r['prompt_tokens']:>7} {r['hit_tokens']:>6} {r['max_abs_dlogit']:>12.4f} {r['top2_margin']:>13.4f} "
            f"{r['tokens_equal']:>4}/{n:<2} {r['common_prefix']:>14}{parted}{tie}"
        )
    lines.append(
        f"max |Δlogit|: median {result['max_abs_dlogit_median']:.4f}, p90 {result['max_abs_dlogit_p90']:.4f}, "
        f"max {result['max_abs_dlogit_max']:.4f}; smallest top-2 margin {result['top2_margin_min']:.4f}, "
        f"below twice the error (near ties) in {result['near_ties']} of {s['prompts']}"
    )
    lines.append(
        f"greedy agreement {result['token_agreement']:.1%}: {result['diverged']} of {s['prompts']} prompts diverged "
        f"within {n} tokens ({result['first_token_diverged']} at the first token)"
        + (
            f", where the exact logits' top two were at most {result['margin_at_divergence_max']:.4f} apart"
            if result["diverged"]
            else ""
        )
    )
    return "\n".join(lines)
