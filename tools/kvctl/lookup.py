"""``kvctl stat KEYHEX`` (where a block's shards live) and ``kvctl match`` (how much of a prompt is stored)."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvctl.ctl import PROG, Ctl, UserError, fmt_size, fmt_when, new_table

SHARD_STATES = {1: "pending", 2: "committed"}
DATA_SHARDS = 10


def _key(ctl: Ctl, text: str) -> bytes:
    length = 16 if ctl.config.hash_algo == "xxh3_128" else 32
    clean = text.strip().lower().removeprefix("0x")
    try:
        key = bytes.fromhex(clean)
    except ValueError:
        key = b""
    if len(key) != length:
        raise UserError(
            f"bad key {text!r}: expected {2 * length} hex digits (a {length}-byte {ctl.config.hash_algo} key)"
        )
    return key


def cmd_stat(ctl: Ctl) -> int:
    key = _key(ctl, ctl.args.key)
    ctl.ensure_reachable()
    info = ctl.client.stat(key)
    holders = ctl.client.placement.shard_nodes([key])[0].tolist()
    now = time.time()
    by_index: dict[int, dict[str, Any]] = {}
    down: list[int] = []
    errors: dict[int, str] = {}
    for shard in info["shards"]:
        if "error" in shard:
            if shard["error"] == "down":
                down.append(shard["node"])
            elif "admin" in str(shard["error"]):
                raise ctl.forbidden()
            else:
                errors[shard["node"]] = str(shard["error"])
            continue
        by_index[int(shard["index"])] = shard
    shards = []
    for index, nid in enumerate(holders):
        shard = by_index.get(index)
        entry: dict[str, Any] = {
            "index": index,
            "kind": "data" if index < DATA_SHARDS else "parity",
            "node": nid,
            "address": ctl.address(nid),
        }
        if shard is None:
            entry["state"] = "node down" if nid in down else ("unknown" if nid in errors else "missing")
        else:
            entry.update(
                state=SHARD_STATES.get(int(shard["state"]), str(shard["state"])),
                length=int(shard["length"]),
                crc=f"{int(shard['crc']):08x}",
                created=shard.get("created"),
            )
        shards.append(entry)
    block = info["block"]
    if block is not None:
        expires = block.get("expires")
        block = {**block, "live": expires is not None and now <= expires}
    committed = sum(1 for s in shards if s["state"] == "committed")
    result = {
        "key": info["key"],
        "primary": info["primary"],
        "primary_down": info["primary"] in down,
        "block": block,
        "shards": shards,
        "committed_shards": committed,
        "down": sorted(set(down)),
    }
    if ctl.json:
        ctl.emit(result)
    else:
        head = new_table("", "")
        head.show_header = False
        head.add_row("block", info["key"])
        head.add_row("primary", f"node {info['primary']} ({ctl.address(info['primary'])})")
        if block is not None:
            state = "live" if block["live"] else ("expired" if block.get("expires") is not None else "unknown class")
            head.add_row("size", f"{fmt_size(block['block_len'])} ({block['block_len']} bytes)")
            head.add_row("class", f"{block['ttl_class']} ({state})")
            head.add_row("created", fmt_when(block["created"], now))
            head.add_row("last access", fmt_when(block["last_access"], now))
            head.add_row("expires", fmt_when(block.get("expires"), now))
        head.add_row("shards", f"{committed}/{len(holders)} committed")
        ctl.print(head)
        table = new_table("index", "kind", "node", "address", "state", "length", "crc", right=("index", "length"))
        for s in shards:
            colour = "green" if s["state"] == "committed" else "yellow" if s["state"] == "pending" else "red"
            table.add_row(
                str(s["index"]),
                s["kind"],
                str(s["node"]),
                s["address"],
                f"[{colour}]{s['state']}[/]",
                str(s.get("length", "-")),
                s.get("crc", "-"),
            )
        ctl.print(table)
    if block is None:
        where = (
            f"primary node {info['primary']} is down, so its record cannot be read"
            if result["primary_down"]
            else f"no block record at primary node {info['primary']}: not stored, expired, evicted or deleted"
        )
        print(f"{PROG}: {where}", file=sys.stderr)
        return 1
    return 0


def _read_tokens(path: Path) -> Any:
    import numpy as np

    if not path.exists():
        raise UserError(f"token file {path} does not exist")
    if path.suffix == ".npy":
        try:
            tokens = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read {path} as a .npy array: {exc}") from None
        tokens = np.asarray(tokens)
        if tokens.ndim == 2 and 1 in tokens.shape:
            tokens = tokens.reshape(-1)  # a (1, n) or (n, 1) array of one prompt
    else:
        try:
            words = path.read_text().split()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read token file {path}: {exc}") from None
        try:
            tokens = np.asarray([int(w) for w in words], dtype=np.int64)
        except ValueError:
            bad = next(w for w in words if not w.lstrip("-").isdigit())
            raise UserError(f"{path}: {bad!r} is not a token id (one integer per line, or a .npy array)") from None
    if tokens.ndim != 1 or (tokens.size and tokens.dtype.kind not in "iu"):
        raise UserError(f"{path}: tokens must be a one-dimensional integer array, got {tokens.dtype} {tokens.shape}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF):
        raise UserError(f"{path}: token ids must be between 0 and 2^32-1")
    return tokens


def cmd_match(ctl: Ctl) -> int:
    from kvtier.kvstore.keys import Namespace, chain

    a = ctl.args
    if a.block_tokens <= 0:
        raise UserError(f"--block-tokens must be positive, got {a.block_tokens}")
    tokens = _read_tokens(Path(a.tokens))
    ns = Namespace(model_id=a.model, kv_dtype=a.dtype, block_tokens=a.block_tokens, layout=a.layout, tenant=a.salt)
    keys = chain(ns, tokens, ctl.config.hash_algo)
    down = ctl.ensure_reachable()
    hit = ctl.client.match(keys) if keys else 0
    result = {
        "tokens": int(tokens.size),
        "blocks": len(keys),
        "hit_blocks": hit,
        "hit_tokens": hit * a.block_tokens,
        "namespace": dataclasses.asdict(ns),
        "down": down,
    }
    if ctl.json:
        ctl.emit(result)
        return 0
    ctl.print(
        f"hit {hit} of {len(keys)} blocks = {hit * a.block_tokens} of {tokens.size} tokens "
        f"({a.block_tokens} tokens per block; a trailing partial block has no key)"
    )
    if down:
        ctl.print(
            f"[yellow]note:[/] nodes {', '.join(map(str, down))} are down; blocks whose primary they are read as misses"
        )
    return 0


def register(commands: Subcommands) -> None:
    p = commands.add("stat", "where a block's shards live, its size, class and times", cmd_stat)
    p.add_argument("key", metavar="KEYHEX", help="the block key in hex (32 digits for xxh3_128 keys)")
    p = commands.add("match", "how many leading blocks of a token file are stored", cmd_match)
    p.add_argument("--tokens", required=True, metavar="FILE", help=".npy array, or one integer per line")
    p.add_argument("--model", required=True, help="model id of the namespace")
    p.add_argument("--dtype", required=True, help="KV dtype of the namespace (e.g. bf16)")
    p.add_argument("--block-tokens", required=True, type=int, metavar="N", help="tokens per block")
    p.add_argument("--layout", required=True, help="KV layout of the namespace (e.g. paged)")
    p.add_argument("--salt", default="", help="the namespace's tenant salt (default none)")
