"""``kvbench fit-cost``: measure an engine's prefill and decode steps and fit the cost model the balancers use.

    kvbench fit-cost [--checkpoint DIR | --preset tiny] [--chunks 512,1024,2048] [--cached 0,2048,4096]
                     [--decode-kv 512,2048,8192] [--repeats 3] [--out cost.json] [--json]

Prefill: for every ``(c, q)`` a prompt of ``c + q`` tokens is computed up to ``c`` in one step, then the step
that computes the other ``q`` tokens is timed (the engine's own clock; medians of ``--repeats``). Decode: one
token's step of ``n`` requests holding ``kv`` tokens each, one batched forward (as a worker's scheduler runs it).
``t(q, c)`` and ``d(n, kv)`` are fitted by least squares (``kvtier.serving.cost.fit``) and the fit's relative
error is reported (RMS and max over the steps).
No store is used: this is compute only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import UsageError
from kvtier.tools.kvbench.enginebench import add_model_arguments, describe


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"expected a comma list of token counts, got {text!r}") from None


def register(commands: Subcommands) -> None:
    p = commands.add("fit-cost", "measure prefill and decode steps and fit the cost model t(q, c)", run)
    p.add_argument("--chunks", default="512,1024,2048", help="new tokens per timed prefill step (q)")
    p.add_argument("--cached", default="0,2048,4096", help="tokens already cached before it (c)")
    p.add_argument("--decode-kv", default="512,2048,8192", help="cached tokens per request in decode steps")
    p.add_argument("--decode-requests", default="1,2,4", help="requests per decode step")
    p.add_argument("--repeats", type=int, default=3, help="timings per point; the median is fitted (3)")
    p.add_argument("--out", help="write the fitted model here (JSON: `kvtier-engine serve --cost-model`)")
    add_model_arguments(p)


def run(args: argparse.Namespace) -> int:
    chunks, cached, kvs, counts = map(_ints, (args.chunks, args.cached, args.decode_kv, args.decode_requests))
    if args.repeats < 1 or min(chunks + counts + kvs) < 1 or min(cached) < 0:
        raise UsageError("--repeats, --chunks, --decode-kv and --decode-requests must be positive, --cached >= 0")
    import numpy as np
    import torch

    from kvtier.engine.checkpoint import make_checkpoint
    from kvtier.engine.engine import Engine
    from kvtier.engine.sampling import GREEDY
    from kvtier.engine.tokenizer_files import SPECIAL
    from kvtier.serving.cost import fit

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvbench-fit-") as tmp:
        checkpoint = args.checkpoint or make_checkpoint(Path(tmp) / args.preset, args.preset, seed=0)
        need = max(cached) + max(chunks) + max(kvs) * max(counts) + 4096
        engine = Engine.from_pretrained(checkpoint, cache_tokens=need)
        rng = np.random.default_rng(0)
        vocab = engine.config.vocab_size

        def prompt(n: int) -> list[int]:
            return rng.integers(len(SPECIAL), vocab, n).tolist()

        engine.generate([prompt(600)], 2, reuse=False)  # warm-up
        prefill: list[tuple[int, int, float]] = []
        for c in cached:
            for q in chunks:
                times = []
                for _ in range(args.repeats):
                    with engine.start(prompt(c + q), 1, GREEDY, reuse=False) as g:
                        if c:
                            g.step(c)
                        before = g.seq.timings.get("compute_s", 0.0)
                        g.step(q)
                        times.append(g.seq.timings["compute_s"] - before)
                prefill.append((q, c, statistics.median(times)))
        decode: list[tuple[int, int, float]] = []
        for n in counts:
            for kv in kvs:
                gens = [engine.start(prompt(kv), 2 + args.repeats, GREEDY, reuse=False) for _ in range(n)]
                for g in gens:
                    g.step()
                times = []
                for _ in range(args.repeats):
                    start = engine._clock()
                    works = [g.work() for g in gens]  # one forward for all: a worker's batched step
                    for g, row in zip(gens, engine.runner.forward(works), strict=True):
                        g.take(row)
                    times.append(engine._clock() - start)
                for g in gens:
                    g.close()
                decode.append((n, n * kv, statistics.median(times)))
    model = fit(prefill, decode)
    if args.out:
        model.save(args.out)
    result = {
        "command": "fit-cost",
        "checkpoint": describe(args),
        "model": model.__dict__,
        "prefill_steps": [{"q": q, "c": c, "s": t, "predicted_s": model.prefill_s(q, c)} for q, c, t in prefill],
        "decode_steps": [{"n": n, "kv": kv, "s": t, "predicted_s": model.decode_s(n, kv)} for n, kv, t in decode],
    }
    print(json.dumps(result, indent=2) if args.json else _text(result, args.out))
    return 0


def _text(result: dict[str, Any], out: str | None) -> str:
    m = result["model"]
    lines = [
        f"cost model of {result['checkpoint']}:",
        f"  t(q, c) = {m['a'] * 1e3:.3f} ms + {m['b'] * 1e6:.3f} µs·q + {m['g'] * 1e9:.4f} ns·q(c + (q+1)/2)",
        f"  d(n, kv) = {m['decode_a'] * 1e3:.3f} ms + {m['decode_b'] * 1e3:.3f} ms·n + {m['decode_g'] * 1e9:.3f} ns·kv",
        f"  prefill fit error: RMS {m['rel_error']:.1%}, max {m['max_rel_error']:.1%} over "
        f"{len(result['prefill_steps'])} steps",
        f"{'q':>7} {'c':>7} {'measured':>10} {'fitted':>10}",
    ]
    for s in result["prefill_steps"]:
        lines.append(f"{s['q']:>7} {s['c']:>7} {s['s'] * 1e3:>8.2f}ms {s['predicted_s'] * 1e3:>8.2f}ms")
    if out:
        lines.append(f"wrote {out}")
    return "\n".join(lines)
