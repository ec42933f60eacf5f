"""``kvbench decode``: continuous batching measured: decode throughput and time between tokens at each concurrency,
against the memory roofline of a step on the same device, and prefill throughput beside decode traffic.

    kvbench decode [--checkpoint DIR | --preset tiny|v4-tiny|...] [--layer-types sliding,full] [--device cpu]
                   [--dtype float32] [--context 2048] [--concurrency 1,8,32,64] [--steps 16]
                   [--mixed 32] [--prefill-chunk 512] [--json]

For each concurrency ``n``: ``n`` requests of ``--context`` prompt tokens are prefilled, then ``--steps`` decode steps
are timed, each one forward for a token of every request (the engine's scheduler step; the device synchronized at
each step's end): **ITL** is the median step, **tokens/s** ``n`` over the mean step. A step's **memory roofline**
is the bytes it must read, every weight once plus each request's KV (its global layers' cached positions, its
sliding layers' window), over the device's memory bandwidth as a copy kernel measures it in the same run
(``dst.copy_(src)`` of up to 4 GiB, 2 × its bytes moved); the roofline fraction is that time
over the measured step. With ``--mixed n``: ``n`` requests decode while new prompts are prefilled beside them, one
``--prefill-chunk`` a step: prefill tokens/s and the ITL the decoding requests see. Dense checkpoints only for the
roofline (DeepSeek-V4's reads depend on what its indexer picks: the fraction is left out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import UsageError
from kvtier.tools.kvbench.enginebench import PRESETS, describe

V4_PRESETS = ("v4-tiny", "v4-h200")


def register(commands: Subcommands) -> None:
    p = commands.add("decode", "decode throughput and ITL per concurrency against the step's memory roofline", run)
    p.add_argument("--checkpoint", type=Path, help="a Hugging Face model directory (default: a seeded preset)")
    presets = [*PRESETS, *V4_PRESETS]
    p.add_argument("--preset", choices=presets, default="tiny", help="seeded checkpoint to build (tiny)")
    p.add_argument("--layer-types", default="sliding,full", help="the preset's layer mix (make-checkpoint's)")
    p.add_argument("--device", default="cpu", help="torch device (cuda: the preset's weights are drawn there)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens of every request (2048)")
    p.add_argument("--concurrency", default="1,8,32,64", help="requests decoding at once, a comma list")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per concurrency (16)")
    p.add_argument("--mixed", type=int, default=32, help="decoding requests beside prefill (0: no mixed run)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens prefilled per mixed step (512)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--concurrency takes a comma list of counts, got {args.concurrency!r}") from None
    if not levels or min(levels) < 1 or args.context < 1 or args.steps < 1 or args.mixed < 0:
        raise UsageError("--concurrency, --context and --steps must be positive, --mixed >= 0")
    import torch

    from kvtier.engine.checkpoint import DTYPES, make_checkpoint
    from kvtier.engine.engine import Engine

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvbench-decode-") as tmp:
        checkpoint = args.checkpoint or make_checkpoint(
            Path(tmp) / args.preset, args.preset, seed=0, layer_types=args.layer_types, device=args.device
        )
        longest = max([*levels, args.mixed])
        cache = longest * (args.context + args.steps + 64) + 4 * (args.context + args.prefill_chunk)
        engine = Engine.from_pretrained(checkpoint, args.device, DTYPES[args.dtype], cache_tokens=cache)
        bandwidth = copy_bandwidth(engine.device, engine.cache.pages.numel() * engine.cache.pages.element_size())
        bench = DecodeBench(engine, args.context, args.steps)
        points = [bench.point(n, bandwidth) for n in levels]
        mixed = bench.mixed(args.mixed, args.prefill_chunk) if args.mixed else None
    base = points[0]
    for p in points:
        p["vs_first_tokens_s"] = p["tokens_s"] / base["tokens_s"]
        p["vs_first_itl"] = p["itl_s"] / base["itl_s"]
    result = {
        "command": "decode",
        "checkpoint": describe(args),
        "device": str(engine.device) + (f" ({torch.cuda.get_device_name()})" if engine.device.type == "cuda" else ""),
        "dtype": args.dtype,
        "context": args.context,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes": bench.weight_bytes,
        "points": points,
        "mixed": mixed,
    }
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0


def copy_bandwidth(device: Any, cache_bytes: int) -> float:
    """Bytes per second a device-to-device copy moves (read + write): a buffer of the cache's size, at least
    256 MiB (far past any cache level) and at most 4 GiB (1 GiB on a CPU: the copy's source and destination must fit
    beside the model), the median of 5 copies."""
    import torch

    size = min(max(256 << 20, cache_bytes), (4 << 30) if device.type != "cpu" else (1 << 30))
    src = torch.ones(size // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        start = _clock(device)
        dst.copy_(src)
        times.append(_clock(device) - start)
    del src, dst
    return 2 * size / statistics.median(times[1:])


def _clock(device: Any) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class DecodeBench:
    """The runs of one engine (see the module doc)."""

    def __init__(self, engine: Any, context: int, steps: int) -> None:
        import numpy as np

        self.engine, self.context, self.steps = engine, context, steps
        self.rng = np.random.default_rng(0)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        self.seq = 0

    def _prompt(self) -> list[int]:
        return self.rng.integers(3, self.engine.config.vocab_size, self.context).tolist()

    def _started(self, n: int) -> list[Any]:
        """``n`` requests whose prompts are computed (each its first token), ready to decode."""
        gens = [self.engine.start(self._prompt(), 1 << 20, reuse=False) for _ in range(n)]
        for g in gens:
            g.step()
        return gens

    def _decode_step(self, gens: list[Any], extra: list[tuple[Any, int]] = ()) -> float:
        """One forward: a token of every request of ``gens`` and the ``(request, tokens)`` prefill pieces of
        ``extra``; its seconds, the device synchronized."""
        engine = self.engine
        start = _clock(engine.device)
        works = [g.work() for g in gens] + [g.work(limit) for g, limit in extra]
        for g, row in zip([*gens, *(g for g, _ in extra)], engine.runner.forward(works), strict=True):
            g.take(row)
        return _clock(engine.device) - start

    def point(self, n: int, bandwidth: float) -> dict[str, Any]:
        gens = self._started(n)
        try:
            for _ in range(2):  # warm-up
                self._decode_step(gens)
            reads = [self.kv_read_bytes(g.cached) for g in gens]
            kv = None if None in reads else sum(reads)
            times = [self._decode_step(gens) for _ in range(self.steps)]
        finally:
            for g in gens:
                g.close()
        itl, mean = statistics.median(times), statistics.fmean(times)
        out: dict[str, Any] = {"concurrency": n, "itl_s": itl, "tokens_s": n / mean, "kv_read_bytes": kv}
        if kv is not None:
            out["roofline_s"] = (self.weight_bytes + kv) / bandwidth
            out["roofline_fraction"] = out["roofline_s"] / mean
        return out

    def kv_read_bytes(self, cached: int) -> int | None:
        """Bytes of KV one request's decode step reads with ``cached`` positions in the cache (dense only)."""
        config = self.engine.config
        if getattr(config, "family", None) == "deepseek_v4":
            return None
        per_token = 2 * config.num_kv_heads * config.head_dim * self.engine.cache.pages.element_size()
        window = min(cached + 1, config.sliding_window or 0)
        return per_token * (len(config.global_layers) * (cached + 1) + len(config.sliding_layers) * window)

    def mixed(self, n: int, chunk: int) -> dict[str, Any]:
        """``n`` requests decoding while new prompts are prefilled beside them, ``chunk`` tokens a step."""
        gens = self._started(n)
        prefilled, times = 0, []
        incoming = self.engine.start(self._prompt(), 1, reuse=False)
        try:
            for _ in range(2):
                self._decode_step(gens)
            for _ in range(self.steps):
                before = incoming.computed or 0
                times.append(self._decode_step(gens, [(incoming, chunk)]))
                prefilled += (incoming.computed or 0) - before if not incoming.finish_reason else self.context - before
                if incoming.finish_reason or not incoming.prompt_left:
                    incoming.close()
                    incoming = self.engine.start(self._prompt(), 1, reuse=False)
        finally:
            for g in [*gens, incoming]:
                g.close()
        return {
            "decoding": n,
            "prefill_chunk": chunk,
            "itl_s": statistics.median(times),
            "decode_tokens_s": n * len(times) / sum(times),
            "prefill_tokens_s": prefilled / sum(times),
        }


def _text(result: dict[str, Any]) -> str:
    lines = [
        f"decode on {result['device']}, {result['checkpoint']}, {result['dtype']}, {result['context']}-token prompts; "
        f"copy bandwidth {result['copy_bandwidth_gb_s']:.1f} GB/s, weights {result['weight_bytes'] / 1e9:.3f} GB",
        f"{'concurrency':>11} {'ITL ms':>9} {'tokens/s':>10} {'× c=first':>10} {'ITL ×':>7} {'roofline':>9}",
    ]
    for p in result["points"]:
        roof = f"{p['roofline_fraction']:.2f}" if "roofline_fraction" in p else "-"
        lines.append(
            f"{p['concurrency']:>11} {p['itl_s'] * 1e3:>9.2f} {p['tokens_s']:>10.1f} {p['vs_first_tokens_s']:>10.2f} "
            f"{p['vs_first_itl']:>7.2f} {roof:>9}"
        )
    m = result["mixed"]
    if m:
        lines.append(
            f"mixed: {m['decoding']} decoding + {m['prefill_chunk']}-token prefill chunks: "
            f"ITL {m['itl_s'] * 1e3:.2f} ms, decode {m['decode_tokens_s']:.1f} tokens/s, "
            f"prefill {m['prefill_tokens_s']:.1f} tokens/s"
        )
    return "\n".join(lines)
