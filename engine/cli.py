"""``kvtier-engine``: write checkpoints, check or refresh the numeric baseline, run the P/D workers.

``kvtier-engine serve`` (the OpenAI-compatible server) is added by ``kvtier.serving.cli``, the installed command.

Errors a user can cause print one line (``kvtier-engine: ...``) and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.engine import baseline, worker
from kvtier.engine.checkpoint import PRESETS, make_checkpoint
from kvtier.engine.deepseek_v4.presets import V4_PRESETS


def _make_checkpoint(args: argparse.Namespace) -> None:
    out = make_checkpoint(
        args.out,
        preset=args.preset,
        seed=args.seed,
        layer_types=args.layer_types,
        sliding_window=args.sliding_window,
        family=args.family,
        tie_word_embeddings=args.tie_word_embeddings,
        device=args.device,
    )
    family = "deepseek_v4" if args.preset in V4_PRESETS else args.family
    print(f"wrote {args.preset} checkpoint ({family}, seed {args.seed}) to {out}")


def _baseline(args: argparse.Namespace) -> None:
    if args.refresh:
        print(f"wrote {baseline.refresh(args.file)}")
        return
    diffs = baseline.check(args.file)
    for line in diffs:
        print(line)
    if diffs:
        raise SystemExit(f"kvtier-engine: {len(diffs)} differences from {args.file}; if intended, run --refresh")
    print(f"matches {args.file}")


def parser() -> argparse.ArgumentParser:
    return parsers()[0]


def parsers() -> tuple[argparse.ArgumentParser, Any]:
    """The command's parser and its subparsers action (``add_parser``; ``choices``: each subcommand's parser by
    name), for a layer above to add subcommands of its own."""
    top = argparse.ArgumentParser(
        prog="kvtier-engine",
        description="kvtier's engine: checkpoints, the numeric baseline, and the prefill and decode workers "
        "(P/D disaggregation through the store: `kvtier-engine prefill --help` has their protocol).",
    )
    sub = top.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-checkpoint", help="write a seeded random checkpoint in Hugging Face format")
    mk.add_argument("out", help="new directory")
    mk.add_argument("--preset", choices=[*sorted(PRESETS), *sorted(V4_PRESETS)], default="tiny")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--layer-types", default="sliding,full", help="comma list of full/sliding, repeated per layer")
    mk.add_argument("--sliding-window", type=int, default=128)
    mk.add_argument("--family", choices=["qwen2", "llama", "mistral"], default="qwen2")
    mk.add_argument("--tie-word-embeddings", action="store_true")
    mk.add_argument("--device", default="cpu", help="draw the weights on this torch device (cuda: fast for 8b)")
    mk.set_defaults(run=_make_checkpoint)

    bl = sub.add_parser("baseline", help="check the engine against the checked-in numeric baseline")
    bl.add_argument("--refresh", action="store_true", help="regenerate the baseline file instead")
    bl.add_argument("--file", type=Path, default=baseline.DEFAULT_FILE)
    bl.set_defaults(run=_baseline)

    for role, what in (("prefill", "compute prompts and store their KV"), ("decode", "generate from stored KV")):
        w = sub.add_parser(
            role,
            help=f"P/D worker: {what} (JSON lines on stdin/stdout)",
            description=f"P/D worker: {what}.",
            epilog=worker.PROTOCOL,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        worker.add_arguments(w)
        w.set_defaults(run=lambda args, role=role: worker.serve(role, args))
    return top, sub


def main(argv: Sequence[str] | None = None, build: Callable[[], argparse.ArgumentParser] = parser) -> int:
    """Run the command line ``argv``, parsed by ``build()``'s parser."""
    args = build().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, OSError) as e:  # UnsupportedModelError is a ValueError
        print(f"kvtier-engine: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
