"""``kvbench kv-format``: the accuracy gate of low-precision KV formats: how far reusing a prefix stored in a format is
from computing it, per format, over a seeded prompt set.

    kvbench [--config PATH] kv-format [--checkpoint DIR | --preset tiny|small|v4-tiny] [--format F ...] [--seed 0]
                                      [--prompts 8] [--lengths 600-3000] [--new-tokens 32] [--device cpu]
                                      [--dtype float32] [--json]

For each prompt (``--prompts`` of them, lengths spread over ``--lengths``, tokens drawn from ``--seed``, which also
seeds the preset's weights) and each format (``--format``, repeatable; default every named one): an engine in that
format stores the prompt's first 80 % (blocks and StateBlocks, encoded; in a store holding no other format's
blocks of these prompts: each format's are deleted after its run), then prefills the whole prompt reusing them
(an exact hit: its blocks and StateBlock decoded) and generates ``--new-tokens`` greedy tokens. Against the same
prompt computed without any reuse in the compute dtype it reports (``agreement.py``, as ``swa-replay`` does): the
first token's max |Δlogit|, greedy agreement, and the exact logits' top-2 margin where a continuation parts from the
exact one. ``exact`` (the compute dtype's bytes) is the floor: the reuse path's own error. Each format's block and
StateBlock bytes are reported beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench import agreement
from kvtier.tools.kvbench.common import BenchError, UsageError
from kvtier.tools.kvbench.enginebench import checkpoint_and_cluster, describe

HIT_FRACTION = 0.8  # of each prompt stored in the format before it is asked whole
FORMATS = ("exact", "bf16", "fp8-e4m3", "mxfp8", "mxfp4", "seed")
PRESETS = ("tiny", "small", "1b", "8b", "v4-tiny", "v4-h200")


def register(commands: Subcommands) -> None:
    p = commands.add("kv-format", "accuracy of reuse from low-precision KV formats against computing the prefix", run)
    p.add_argument(
        "--format",
        action="append",
        dest="formats",
        metavar="F",
        help=f"a KV format, repeatable (default: {', '.join(FORMATS)}); KIND=CODEC,... too",
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts in the set (default 8)")
    p.add_argument("--lengths", default="600-3000", metavar="MIN-MAX", help="prompt lengths, spread evenly (600-3000)")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts and the preset checkpoint (default 0)")
    p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens compared (default 32)")
    p.add_argument("--checkpoint", type=Path, help="a Hugging Face model directory (default: a seeded preset)")
    p.add_argument("--preset", choices=PRESETS, default="tiny", help="seeded checkpoint to build (tiny)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--node-capacity", default="2GiB", help="each node's capacity in the temporary cluster (2GiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    if min(args.prompts, args.new_tokens, args.threads) < 1:
        raise UsageError("--prompts, --new-tokens and --threads must be at least 1")
    lengths = agreement.lengths(args.lengths, args.prompts)
    import torch

    from kvtier.engine import Engine
    from kvtier.engine.formats import FormatError
    from kvtier.engine.stateblocks import LocalStateBlocks

    dtype = getattr(torch, args.dtype)
    with checkpoint_and_cluster(args, "kvbench-kv-format-", seed=args.seed) as (checkpoint, config, _):
        reference = Engine.from_pretrained(checkpoint, args.device, dtype)
        if reference.config.max_position_embeddings <= lengths[-1] + args.new_tokens:
            raise UsageError(f"--lengths {args.lengths}: the model takes {reference.config.max_position_embeddings}")
        prompts = [
            np.random.default_rng((args.seed, i)).integers(0, reference.config.vocab_size, n).tolist()
            for i, n in enumerate(lengths)
        ]
        exact = [reference.generate([p], args.new_tokens, reuse=False)[0] for p in prompts]
        formats: dict[str, Any] = {}
        for name in args.formats or FORMATS:
            try:
                engine = Engine.from_pretrained(
                    checkpoint, args.device, dtype, store=config, state_blocks=LocalStateBlocks(1 << 30), kv_format=name
                )
            except FormatError as e:
                raise UsageError(str(e)) from None
            with engine:
                rows = []
                for i, (p, want) in enumerate(zip(prompts, exact, strict=True)):
                    engine.generate([p[: int(len(p) * HIT_FRACTION)]], 1)
                    [got] = engine.generate([p], args.new_tokens)
                    if got.replayed or not got.hit_tokens:
                        raise BenchError(f"{name}, prompt {i}: expected an exact hit, got {got.hit_tokens} tokens "
                                         f"(replayed={got.replayed})")  # fmt: skip
                    rows.append({"prompt_tokens": len(p), **agreement.compare(got, want, reference.logits, p)})
                assert engine.store is not None  # each format starts from a store without the prompts' blocks:
                for p in prompts:  # formats of equal block codecs share blocks, not StateBlocks (a replay)
                    engine.store.client.delete(engine.store.keys(p))
            formats[name] = {
                "block_bytes": engine.block_bytes,
                "page_bytes": engine.cache.page_bytes,
                "state_block_bytes": engine.state_bytes,
                "prompts": rows,
                **agreement.summarize(rows, args.new_tokens),
            }
    result = {
        "command": "kv-format",
        "settings": {
            "checkpoint": describe(args),
            "seed": args.seed,
            "prompts": len(prompts),
            "lengths": args.lengths,
            "new_tokens": args.new_tokens,
            "device": args.device,
            "dtype": args.dtype,
        },
        "formats": formats,
    }
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0


def _text(result: dict[str, Any]) -> str:
    s = result["settings"]
    n = s["new_tokens"]
    lines = [
        f"reuse from KV formats vs computing the prefix, {s['checkpoint']}, {s['device']} {s['dtype']}, "
        f"{s['prompts']} prompts of {s['lengths']} tokens drawn from seed {s['seed']}, {n} greedy tokens"
    ]
    for name, f in result["formats"].items():
        lines += [
            "",
            f"{name}: a block {f['block_bytes']:,} B ({f['block_bytes'] / f['page_bytes']:.3f} of the page), a "
            f"StateBlock {f['state_block_bytes']:,} B",
            agreement.header(),
            *(agreement.line(r, n) for r in f["prompts"]),
            *agreement.summary_lines(f, s["prompts"], n),
        ]
    return "\n".join(lines)
