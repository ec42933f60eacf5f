"""An engine serving with kvtier as its external KV store, end to end on a GPU: the same 768-token prompt twice, the
engine's own caches flushed in between, and the second answer's cached tokens read from kvtier.

    python3 dev/gpu_adapter_check.py OUT --engine vllm      # vllm 0.33.0 installed, with kvtier
    python3 dev/gpu_adapter_check.py OUT --engine sglang    # sglang 0.5.23 installed (and its kernels)

Prepared, not run here: the lent GPU machine has torch 2.11 and no network, and neither engine could be carried to
it (docs/adapters.md, "On a GPU", gives the sizes and what is missing). On a machine with the engine:

1. a local 12-node kvtier cluster (real node processes; their Prometheus ``/metrics`` count the bytes they serve);
2. a small Llama checkpoint with random weights, written with transformers (no tokenizer: token ids go in as is);
3. the engine started with kvtier as its store: vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` and
   the ``KvtierTier`` secondary tier; SGLang with HiCache and the ``dynamic`` storage backend ``KvtierHiCacheStorage``;
4. the prompt sent (its KV is written through to kvtier), the engine's caches flushed (vLLM:
   ``reset_prefix_cache``, which also empties the CPU tier; SGLang: ``/flush_cache``), the prompt sent again;
5. passes when the second answer reports at least 700 cached tokens and the nodes served the bytes of at least 700
   tokens' KV meanwhile. Writes ``OUT/adapter_check.json``; exits non-zero when it fails.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 768
EXPECTED_CACHED = 700
LAYERS, HEADS, HEAD_DIM = 4, 4, 64  # the checkpoint: KV bytes per token = 2 * layers * heads * head_dim * 2 (bf16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--engine", choices=("vllm", "sglang"), required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from kvtier.kvstore.cluster import config as cluster_mod
    from kvtier.kvstore.cluster.local import LocalCluster

    with tempfile.TemporaryDirectory(prefix="kvtier-gpu-adapter-") as tmp:
        path = cluster_mod.write_default(Path(tmp) / "store", capacity_bytes=1 << 30, metrics=True)
        checkpoint = write_checkpoint(Path(tmp) / "ckpt")
        with LocalCluster(path) as cluster:
            nodes = [n.metrics_port for n in cluster.config.nodes.values()]
            run = run_vllm if args.engine == "vllm" else run_sglang
            result = run(checkpoint, path, lambda: bytes_served(nodes))
    kv_bytes = PROMPT_TOKENS * 2 * LAYERS * HEADS * HEAD_DIM * 2
    result.update(engine=args.engine, prompt_tokens=PROMPT_TOKENS, kv_bytes_per_prompt=kv_bytes)
    result["passed"] = (
        result["cached_tokens"] >= EXPECTED_CACHED
        and result["bytes_read_from_kvtier"] >= EXPECTED_CACHED * kv_bytes // PROMPT_TOKENS
    )
    (args.out / "adapter_check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


def write_checkpoint(directory: Path) -> Path:
    """A small Llama with random weights (safetensors), enough for an engine to run a 768-token prompt."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=HEADS * HEAD_DIM,
        intermediate_size=4 * HEADS * HEAD_DIM,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    return directory


def bytes_served(metrics_ports: list[int]) -> int:
    """Payload bytes the nodes have sent so far (their Prometheus counters)."""
    total = 0
    for port in metrics_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith('kvtier_node_bytes_total{direction="out"}'):
                total += int(float(line.split()[-1]))
    return total


def prompt() -> list[int]:
    return [(7919 * i) % 31000 + 100 for i in range(PROMPT_TOKENS)]


def run_vllm(checkpoint: Path, store: Path, served: Any) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    tier = {"type": "KvtierTier", "module_path": "kvtier.adapters.vllm", "config": str(store)}
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": 1 << 30,
            "secondary_tiers": [tier],
        },
    )
    llm = LLM(
        model=str(checkpoint),
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        enable_prefix_caching=True,
        kv_transfer_config=transfer,
    )
    once = SamplingParams(max_tokens=1, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompt())], once)
    time.sleep(2)  # the cascade to kvtier is asynchronous: let it land
    llm.reset_prefix_cache()
    before = served()
    (second,) = llm.generate([TokensPrompt(prompt_token_ids=prompt())], once)
    return {"cached_tokens": int(second.num_cached_tokens or 0), "bytes_read_from_kvtier": served() - before}


def run_sglang(checkpoint: Path, store: Path, served: Any) -> dict[str, Any]:
    port = 30123
    extra = {
        "backend_name": "kvtier",
        "module_path": "kvtier.adapters.sglang",
        "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1,
        "config": str(store),
    }
    argv = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(checkpoint), "--skip-tokenizer-init",
        "--port", str(port), "--page-size", "16", "--disable-cuda-graph", "--mem-fraction-static", "0.3",
        "--enable-hierarchical-cache", "--hicache-write-policy", "write_through",
        "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra),
    ]  # fmt: skip
    server = subprocess.Popen(argv)
    try:
        _wait_ready(port)
        body = {"input_ids": prompt(), "sampling_params": {"max_new_tokens": 1}}
        _post(port, "/generate", body)
        time.sleep(2)  # write-through to kvtier is asynchronous
        _post(port, "/flush_cache", {})
        before = served()
        second = _post(port, "/generate", body)
        return {
            "cached_tokens": int(second["meta_info"].get("cached_tokens", 0)),
            "bytes_read_from_kvtier": served() - before,
        }
    finally:
        server.terminate()
        server.wait(60)


def _wait_ready(port: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"the SGLang server did not answer within {timeout_s:.0f} s")


def _post(port: int, route: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{route}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        text = reply.read().decode()
    return json.loads(text) if text.strip().startswith(("{", "[")) else text


if __name__ == "__main__":
    sys.exit(main())
