"""aiperf against ``kvtier-engine serve`` (with an API key), and the same run with an 8 MB prompt in the middle.

    python benchmarks/aiperf_bench.py [--aiperf PATH] [--prefill 0 --decode 0] [--request-count 60]
                                      [--concurrency 4] [--isl 300] [--osl 16] [--big-prompt-mb 8] [--json]

Starts a local 12-node cluster, writes the tiny seed-0 checkpoint, starts the server (embedded, or with
``--prefill N --decode M`` worker processes) with ``--api-key``, and runs ``aiperf profile`` (streaming
completions, synthetic prompts of ``--isl`` tokens from the checkpoint's tokenizer, ``--osl`` tokens out,
``ignore_eos``) twice: alone, then again while, halfway through (half the first run's duration), one request with
an ``--big-prompt-mb`` MB text prompt is sent. Reports each run's requests, errors and TTFT p50 / p99 (aiperf's),
the big request's status and time, and p99 with / without. Targets (issue 34): 0 errors, p99 within 2x.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvtier.engine.checkpoint import make_checkpoint
from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.tools.benchutil import start_serve
from kvtier.tools.kvbench.common import stop_process

KEY = "sk-aiperf-bench-0123456789"


def start_server(checkpoint: Path, store: Path, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    options = ["--checkpoint", str(checkpoint), "--store", str(store), "--served-model-name", "tiny", "--api-key", KEY,
               "--prefill", str(args.prefill), "--decode", str(args.decode), "--disable-access-log"]  # fmt: skip
    return start_serve(options, "aiperf_bench", stdout=sys.stderr)


def aiperf(args: argparse.Namespace, url: str, checkpoint: Path, out: Path) -> tuple[dict[str, Any], float]:
    argv = [args.aiperf, "profile", "--model", "tiny", "--url", url, "--endpoint-type", "completions",
            "--streaming", "--api-key", KEY, "--tokenizer", str(checkpoint), "--synthetic-input-tokens-mean",
            str(args.isl), "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.osl),
            "--extra-inputs", "ignore_eos:true", "--request-count", str(args.request_count), "--concurrency",
            str(args.concurrency), "--artifact-dir", str(out), "--random-seed", "1"]  # fmt: skip
    began = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True)
    took = time.monotonic() - began
    if done.returncode != 0:
        raise SystemExit(
            f"aiperf_bench: aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    exported = next(out.rglob("profile_export_aiperf.json"))
    return json.loads(exported.read_text()), took


def summary(report: dict[str, Any]) -> dict[str, Any]:
    ttft = report.get("time_to_first_token", {})
    count = report.get("request_count", {})
    errors = report.get("error_request_count", {})
    return {
        "requests": count.get("avg") if isinstance(count, dict) else count,
        "errors": (errors.get("avg") if isinstance(errors, dict) else errors) or 0,
        "ttft_p50_ms": ttft.get("p50"),
        "ttft_p99_ms": ttft.get("p99"),
        "unit": ttft.get("unit"),
    }


def big_request(url: str, mb: int, at_s: float, result: dict[str, Any]) -> None:
    time.sleep(at_s)
    body = json.dumps({"model": "tiny", "prompt": "word " * ((mb << 20) // 5), "max_tokens": 4}).encode()
    began = time.monotonic()
    r = httpx.post(url + "/v1/completions", content=body, timeout=600,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})  # fmt: skip
    result.update(status=r.status_code, seconds=time.monotonic() - began, sent_after_s=at_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf command (pip install aiperf)")
    parser.add_argument("--prefill", type=int, default=0)
    parser.add_argument("--decode", type=int, default=0)
    parser.add_argument("--request-count", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--isl", type=int, default=300)
    parser.add_argument("--osl", type=int, default=16)
    parser.add_argument("--big-prompt-mb", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-aiperf-") as tmp:
        checkpoint = make_checkpoint(Path(tmp) / "tiny", "tiny", seed=0)
        path = cluster_mod.write_default(Path(tmp) / "cluster", capacity_bytes=256 << 20, metrics=False)
        with LocalCluster(path) as local:
            proc, url = start_server(checkpoint, local.config_path, args)
            try:
                alone, took = aiperf(args, url, checkpoint, Path(tmp) / "alone")
                big: dict[str, Any] = {}
                thread = threading.Thread(target=big_request, args=(url, args.big_prompt_mb, took / 2, big))
                thread.start()
                with_big, _ = aiperf(args, url, checkpoint, Path(tmp) / "with-big")
                thread.join()
            finally:
                stop_process(proc, timeout_s=120)
    mode = "embedded" if not args.prefill else f"{args.prefill} prefill + {args.decode} decode"
    result = {"mode": mode, "alone": summary(alone), "with_big_prompt": summary(with_big), "big_request": big}
    a, b = result["alone"]["ttft_p99_ms"], result["with_big_prompt"]["ttft_p99_ms"]
    result["p99_ratio"] = b / a if a and b else None
    print(json.dumps(result, indent=2))
    ok = result["alone"]["errors"] == 0 and result["with_big_prompt"]["errors"] == 0
    return 0 if ok and (result["p99_ratio"] or 0) <= 2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
