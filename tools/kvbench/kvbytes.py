"""``kvbench kv-bytes``: what a model's KV costs in each tier and in StateBlocks, per KV format, from its shape alone.

    kvbench kv-bytes [--models 8b,v4-h200,v4-flash] [--checkpoint DIR ...] [--dtype bfloat16]
                     [--kv-format F ...] [--node-capacity 4TiB] [--nodes 12] [--json]

For each model: its family, the block size the engine uses (``block_tokens``), and per KV format (``--kv-format``,
repeatable; default ``exact``, ``bf16``, ``fp8-e4m3``, ``mxfp8``, ``mxfp4`` and ``seed``; docs/engine.md): a stored
block's bytes and its **bytes per token in each tier**: HBM (the pages: the compute dtype, whatever the format), the
host pool and the wire (the encoded block: what a prefix hit reads, per reused token), the store (each block as 12
shards in slab slots: ``tools/capacity.py``); a StateBlock's bytes (what the StateBlock pool holds per saved
position); and the **store's capacity** in blocks and tokens for a cluster of ``--nodes`` nodes of
``--node-capacity`` (as its nodes count it). A format a model cannot take is said in its row. Models are presets of
``kvtier-engine make-checkpoint`` (the dense ``8b`` as the GPU runs lay it out: three sliding layers to one global),
``v4-flash`` (DeepSeek-V4-Flash's shape as transformers' ``DeepseekV4Config`` defaults give it: 43 layers of
64 × 512 heads in transformers' default layer mix), or any checkpoint directory (its ``config.json``). No weights are
read or made.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.kvstore.codec import TOTAL_SHARDS
from kvtier.kvstore.units import parse_size
from kvtier.tools.capacity import local_capacity
from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench.common import UsageError

DEFAULT_MODELS = "tiny,8b,v4-tiny,v4-h200,v4-flash"
FORMATS = ("exact", "bf16", "fp8-e4m3", "mxfp8", "mxfp4", "seed")
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
    p.add_argument(
        "--kv-format",
        action="append",
        dest="formats",
        metavar="F",
        help=f"a KV format, repeatable (default: {', '.join(FORMATS)})",
    )
    p.add_argument("--node-capacity", default="4TiB", help="each store node's capacity (default 4TiB)")
    p.add_argument("--nodes", type=int, default=12, help="store nodes, a multiple of 12 (default 12)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvtier.engine.checkpoint import read_config

    dtype = getattr(torch, args.dtype)
    models = [(name, *model(name)) for name in [m.strip() for m in args.models.split(",") if m.strip()]]
    for path in args.checkpoint:
        family, config = read_config(path)
        models.append((str(path), family, config))
    try:
        node_bytes = parse_size(args.node_capacity)
        local_capacity(node_bytes, 1 << 20, args.nodes)
    except ValueError as e:
        raise UsageError(f"--node-capacity / --nodes: {e}") from None
    store = (node_bytes, args.nodes)
    rows = [
        _row(name, family, config, dtype, f, store) for name, family, config in models for f in args.formats or FORMATS
    ]
    settings = {"dtype": args.dtype, "node_capacity_bytes": node_bytes, "nodes": args.nodes}
    if args.json:
        print(json.dumps({"command": "kv-bytes", **settings, "models": rows}, indent=2))
    else:
        print(_table(rows, args.dtype, args.node_capacity, args.nodes))
    return 0


def model(name: str) -> tuple[Any, Any]:
    """The family and config of a preset (or ``v4-flash``) by name, as the GPU runs lay it out; UsageError (one line)
    for a name that is none."""
    from kvtier.engine.checkpoint import PRESETS, config_dict, parse_layer_types
    from kvtier.engine.deepseek_v4.presets import V4_PRESETS, v4_config_dict
    from kvtier.engine.family import family_of

    if name in PRESETS:
        p = PRESETS[name]
        raw = config_dict(p, "qwen2", parse_layer_types(DENSE_LAYER_TYPES, p.num_layers), 128)
    elif name in V4_PRESETS:
        raw = v4_config_dict(V4_PRESETS[name])
    elif name == "v4-flash":
        raw = dict(V4_FLASH)
    else:
        raise UsageError(f"unknown model {name!r}; presets {', '.join([*PRESETS, *V4_PRESETS])}, v4-flash")
    family = family_of(raw, name)
    return family, family.parse(raw, name)


def _row(name: str, family: Any, config: Any, dtype: Any, kv_format: str, store: tuple[int, int]) -> dict[str, Any]:
    import torch

    from kvtier.engine.formats import FormatError, KVFormat

    block_tokens = family.block_tokens(config, None)
    pages = family.pages(config, 1, block_tokens, dtype, torch.device("meta"))
    row: dict[str, Any] = {
        "model": name,
        "family": family.name,
        "layers": config.num_layers,
        "block_tokens": block_tokens,
        "kv_format": kv_format,
        "hbm_bytes_per_token": pages.page_bytes / block_tokens,
    }
    try:
        fmt = KVFormat.parse(kv_format)
        block_form, state_form = fmt.layouts(family.kv_parts(config, block_tokens, dtype), dtype)
        block, state = block_form.encoded_bytes, state_form.encoded_bytes
    except FormatError as e:
        return {**row, "error": str(e)}
    held = local_capacity(store[0], block, store[1])
    return {
        **row,
        "block_bytes": block,
        "block_bytes_per_token": block / block_tokens,  # the host pool's and the wire's
        "store_bytes_per_token": TOTAL_SHARDS * held.slot_bytes / block_tokens,
        "state_block_bytes": state,
        "store_blocks": held.blocks,
        "store_tokens": held.blocks * block_tokens,
    }


def _table(rows: list[dict[str, Any]], dtype: str, node_capacity: str, nodes: int) -> str:
    lines = [
        f"KV bytes, compute dtype {dtype}, per KV format. B/token per tier: HBM (pages), pool/wire (the encoded block "
        f"a hit reads), store (12 shards in slab slots); capacity: {nodes} nodes of {node_capacity}",
        f"{'model':<18} {'format':<10} {'block tok':>9} {'block B':>11} {'HBM':>8} {'pool/wire':>10} {'store':>8} "
        f"{'StateBlock B':>13} {'store blocks':>13} {'store Mtokens':>14}",
    ]
    for r in rows:
        head = f"{r['model']:<18} {r['kv_format']:<10} {r['block_tokens']:>9}"
        if "error" in r:
            lines.append(f"{head} cannot take this format: {r['error']}")
            continue
        lines.append(
            f"{head} {r['block_bytes']:>11,} {r['hbm_bytes_per_token']:>8,.0f} {r['block_bytes_per_token']:>10,.0f} "
            f"{r['store_bytes_per_token']:>8,.0f} {r['state_block_bytes']:>13,} {r['store_blocks']:>13,} "
            f"{r['store_tokens'] / 1e6:>14,.1f}"
        )
    return "\n".join(lines)
