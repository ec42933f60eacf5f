"""``kvbench kv-bytes``: what a model's KV costs in the store and in StateBlocks, from its shape alone.

    kvbench kv-bytes [--models 8b,v4-h200,v4-flash] [--checkpoint DIR ...] [--dtype bfloat16] [--json]

For each model: its family, the block size the engine uses (``block_tokens``), a stored block's bytes and the
**block bytes per token** (what a prefix hit reads from the store, per reused token), and a StateBlock's bytes (what
the StateBlock pool holds per saved position). Models are presets of ``kvtier-engine make-checkpoint`` (the dense
``8b`` as the GPU runs lay it out: three sliding layers to one global), ``v4-flash`` (DeepSeek-V4-Flash's shape as
transformers' ``DeepseekV4Config`` defaults give it: 43 layers of 64 × 512 heads in transformers' default layer mix),
or any checkpoint directory (its ``config.json``). No weights are read or made.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import UsageError

DEFAULT_MODELS = "tiny,8b,v4-tiny,v4-h200,v4-flash"
DENSE_LAYER_TYPES = "sliding,sliding,sliding,full"  # the GPU runs' 8 B layout (dev/gpu_ttft.py)
V4_FLASH = {  # transformers' DeepseekV4Config defaults (checkpoint deepseek-ai/DeepSeek-V4-Flash-Base)
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "hc_mult": 4,
}


def register(commands: Subcommands) -> None:
    p = commands.add("kv-bytes", "block and StateBlock bytes per token of model shapes (no weights)", run)
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"presets and v4-flash, comma-separated ({DEFAULT_MODELS})")
    p.add_argument("--checkpoint", type=Path, action="append", default=[], help="a checkpoint directory (repeatable)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="KV dtype (default bfloat16)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.engine.checkpoint import PRESETS, config_dict, parse_layer_types, read_config
    from kvtier.engine.deepseek_v4.presets import V4_PRESETS, v4_config_dict
    from kvtier.engine.family import family_of

    dtype = getattr(torch, args.dtype)
    models: list[tuple[str, Any, Any]] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name in PRESETS:
            p = PRESETS[name]
            raw = config_dict(p, "qwen2", parse_layer_types(DENSE_LAYER_TYPES, p.num_layers), 128)
        elif name in V4_PRESETS:
            raw = v4_config_dict(V4_PRESETS[name])
        elif name == "v4-flash":
            raw = dict(V4_FLASH)
        else:
            raise UsageError(
                f"--models: unknown model {name!r}; presets {', '.join([*PRESETS, *V4_PRESETS])}, v4-flash"
            )
        family = family_of(raw, name)
        models.append((name, family, family.parse(raw, name)))
    for path in args.checkpoint:
        family, config = read_config(path)
        models.append((str(path), family, config))
    rows = [_row(name, family, config, dtype) for name, family, config in models]
    if args.json:
        print(json.dumps({"command": "kv-bytes", "dtype": args.dtype, "models": rows}, indent=2))
    else:
        print(_table(rows, args.dtype))
    return 0


def _row(name: str, family: Any, config: Any, dtype: Any) -> dict[str, Any]:
    import torch

    block_tokens = family.block_tokens(config, None)
    pages = family.pages(config, 1, block_tokens, dtype, torch.device("meta"))
    return {
        "model": name,
        "family": family.name,
        "layers": config.num_layers,
        "block_tokens": block_tokens,
        "block_bytes": pages.page_bytes,
        "block_bytes_per_token": pages.page_bytes / block_tokens,
        "state_block_bytes": family.state_bytes(config, dtype),
    }


def _table(rows: list[dict[str, Any]], dtype: str) -> str:
    lines = [
        f"KV bytes in {dtype} (a block: what a prefix hit reads per block; a StateBlock: one saved position)",
        f"{'model':<24} {'family':<12} {'layers':>6} {'block tok':>9} {'block B':>11} {'B/token':>10} "
        f"{'StateBlock B':>13}",
    ]
    for r in rows:
        lines.append(
            f"{r['model']:<24} {r['family']:<12} {r['layers']:>6} {r['block_tokens']:>9} {r['block_bytes']:>11,} "
            f"{r['block_bytes_per_token']:>10,.0f} {r['state_block_bytes']:>13,}"
        )
    return "\n".join(lines)
