"""aiperf against ``kvtier-engine serve`` at several concurrencies in one run: what continuous batching buys.

    python benchmarks/batching_bench.py [--aiperf PATH] [--concurrency 1,4,16] [--requests-per-stream 6]
                                        [--isl 128] [--osl 64] [--threads 1] [--json]

Starts a local 12-node cluster, writes the tiny seed-0 checkpoint, starts the embedded server once, and runs
``aiperf profile`` (streaming completions, synthetic prompts of ``--isl`` tokens from the checkpoint's tokenizer,
``--osl`` tokens out, ``ignore_eos``) at each concurrency, ``--requests-per-stream`` × concurrency requests each
(after a warm-up). Reports, per concurrency, aiperf's output tokens/s, ITL p50, TTFT p50, errors, and the output
tokens/s as a ratio to the first concurrency's (issue 33's target on the CPU: ≥ 4× at 16 against 1).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtier.engine.checkpoint import make_checkpoint
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.tools.benchutil import start_serve
from kvtier.tools.kvbench.common import stop_process


def start_server(checkpoint: Path, store: Path, threads: int) -> tuple[subprocess.Popen, str]:
    options = ["--checkpoint", str(checkpoint), "--store", str(store), "--served-model-name", "tiny", "--threads",
               str(threads), "--disable-access-log"]  # fmt: skip
    return start_serve(options, "batching_bench")


def profile(args: argparse.Namespace, url: str, checkpoint: Path, concurrency: int, out: Path) -> dict[str, Any]:
    argv = [args.aiperf, "profile", "--model", "tiny", "--url", url, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", str(checkpoint), "--synthetic-input-tokens-mean", str(args.isl),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.osl),
            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--request-count",
            str(args.requests_per_stream * concurrency), "--warmup-request-count", str(concurrency),
            "--concurrency", str(concurrency), "--artifact-dir", str(out), "--random-seed", "1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(
            f"batching_bench: aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    report = json.loads(next(out.rglob("profile_export_aiperf.json")).read_text())

    def metric(name: str, stat: str = "avg") -> float | None:
        value = report.get(name)
        return value.get(stat) if isinstance(value, dict) else value

    return {
        "concurrency": concurrency,
        "requests": metric("request_count"),
        "errors": metric("error_request_count") or 0,
        "output_tokens_s": metric("output_token_throughput"),
        "itl_p50_ms": metric("inter_token_latency", "p50"),
        "ttft_p50_ms": metric("time_to_first_token", "p50"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf command (pip install aiperf)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-stream", type=int, default=6)
    parser.add_argument("--isl", type=int, default=128)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvtier-batching-") as tmp:
        checkpoint = make_checkpoint(Path(tmp) / "tiny", "tiny", seed=0)
        path = cluster_mod.write_default(Path(tmp) / "cluster", capacity_bytes=256 << 20, metrics=False)
        with LocalCluster(path) as local:
            proc, url = start_server(checkpoint, local.config_path, args.threads)
            try:
                points = [profile(args, url, checkpoint, c, Path(tmp) / f"c{c}") for c in levels]
            finally:
                stop_process(proc)
    for p in points:
        p["vs_first"] = (p["output_tokens_s"] or 0) / (points[0]["output_tokens_s"] or 1)
    if args.json:
        print(json.dumps({"isl": args.isl, "osl": args.osl, "points": points}, indent=2))
        return 0
    print(f"aiperf, tiny preset, embedded serve, {args.isl} tokens in, {args.osl} out (ignore_eos), streaming")
    head = ("concurrency", "requests", "errors", "out tok/s", "× first", "ITL p50", "TTFT p50")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (11, 9, 7, 10, 8, 9, 9), strict=True)))
    for p in points:
        print(f"{p['concurrency']:>11} {p['requests']:>9.0f} {p['errors']:>7.0f} {p['output_tokens_s']:>10.1f} "
              f"{p['vs_first']:>8.2f} {p['itl_p50_ms']:>7.1f}ms {p['ttft_p50_ms']:>7.1f}ms")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
