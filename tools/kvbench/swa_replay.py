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
from typing import Any

import numpy as np

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench import agreement
from kvtier.tools.kvbench.agreement import compare
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


def run(args: argparse.Namespace) -> int:
    if min(args.prompts, args.new_tokens, args.threads) < 1:
        raise UsageError("--prompts, --new-tokens and --threads must be at least 1")
    lengths = agreement.lengths(args.lengths, args.prompts)
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
            rows.append({"prompt_tokens": length, **compare(replayed, exact, consumer.logits, prompt)})
    print(json.dumps(summarize(rows, args), indent=2) if args.json else _text(summarize(rows, args)))
    return 0


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The per-prompt rows and their distribution (the JSON ``kvbench swa-replay --json`` prints)."""
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
        **agreement.summarize(rows, args.new_tokens),
    }


def _text(result: dict[str, Any]) -> str:
    s = result["settings"]
    n = s["new_tokens"]
    lines = [
        f"bounded SWA replay vs exact, {s['checkpoint']}, {s['prompts']} prompts of {s['lengths']} tokens drawn "
        f"from seed {s['seed']}, {n} greedy tokens",
        agreement.header(),
        *(agreement.line(r, n) for r in result["prompts"]),
        *agreement.summary_lines(result, s["prompts"], n),
    ]
    return "\n".join(lines)
