"""``kvbench swapin``: blocks from staging slots into a paged KV cache (and back), against plain copies of the same
bytes between the same memory, measured in the same run.

    kvbench swapin [--page-sizes 16KiB,64KiB] [--cpu-bytes 256MiB] [--gpu-bytes 1GiB] [--rounds 5] [--no-gpu]
                   [--no-cpu] [--json] [--json-out PATH]

For each page size the slots are a real POSIX shared-memory segment (as the staging pool's) of one slot per block,
and the KV cache a tensor of twice as many pages; block ``b`` goes from a random slot to a random page (two random
permutations), so nothing is contiguous. Every method runs once untimed and is checked (every destination byte
against its source, destination poisoned first), then ``--rounds`` times interleaved with the others; figures are
medians, GB/s are 1e9 bytes of block data a second.

**CPU**, one thread each (``torch.set_num_threads(1)``): ``swap_in`` and ``swap_out`` against the faster of two
contiguous copies of the same bytes from the segment into the cache tensor: glibc ``memcpy`` (``ctypes.memmove``)
and torch ``copy_``. Also torch's ``index_copy_`` path (the kernels' reference), for the record. Target: swap-in ≥
0.8x the contiguous copy.

**GPU** (a CUDA device and tilelang present, unless ``--no-gpu``): the segment registered with CUDA
(``CudaHostMapping``), the cache in device memory. ``swap_in`` (the TileLang gather reading the segment across PCIe;
timed end to end: argument checks, the ids' writing into mapped host memory and their check on the device
included; the ids are the int64 tensors of ``torch.randperm``, narrowed to int32 by the call) against one contiguous
``cudaMemcpyAsync`` of the same bytes from a pinned buffer (the link), with one ``cudaMemcpyAsync`` per block (torch
``copy_`` of each slot into its page) and the contiguous copy from the registered segment beside them; the same
bytes as ``swap_in`` calls of 128 MiB queued back to back, as the engine issues them (``swap_in_grouped``: each
call's host work overlaps the previous call's copy); ``swap_out`` (the scatter into the segment) against one
contiguous device → pinned copy; and the kernel alone at 128, 256 and 512 threads a CTA. Target: swap-in ≥ 0.9x
the contiguous pinned copy.

``--json`` prints one object instead of the table; ``--json-out`` also writes it to a file. A wrong byte anywhere
stops the run (``kvbench: DATA MISMATCH``, exit status 1).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.kvstore.units import format_size, parse_size
from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvbench import swapin_format
from kvtier.tools.kvbench.common import UsageError, VerifyError
from kvtier.tools.kvbench.swapmem import median_times, random_ids, segment

THREAD_VARIANTS = (128, 256, 512)
GROUP_BYTES = 128 << 20  # the engine swaps a fetch in groups of this size (engine/fetch.py): one call each


def register(commands: Subcommands) -> None:
    p = commands.add("swapin", "swap-in/out between staging slots and a paged KV cache, against plain copies", run)
    p.add_argument(
        "--page-sizes", default="16KiB,64KiB", help="comma-separated page (block) sizes (default 16KiB,64KiB)"
    )
    p.add_argument("--cpu-bytes", default="256MiB", help="bytes moved per CPU call (default 256MiB)")
    p.add_argument("--gpu-bytes", default="1GiB", help="bytes moved per GPU call (default 1GiB)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per method (default 5)")
    p.add_argument("--no-gpu", action="store_true", help="CPU figures only, even where a GPU is present")
    p.add_argument("--no-cpu", action="store_true", help="GPU figures only")
    p.add_argument(
        "--kv-format",
        action="append",
        dest="formats",
        metavar="F",
        help="instead of the page sizes: a model's blocks in KV format F, decoded by the swap-in (repeatable)",
    )
    p.add_argument("--model", default="8b", help="the model whose blocks --kv-format takes (default 8b; v4-h200, ...)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--json-out", type=Path, help="also write the JSON object to this file")


def run(args: argparse.Namespace) -> int:
    try:
        pages = [parse_size(s) for s in args.page_sizes.split(",")]
        cpu_bytes, gpu_bytes = parse_size(args.cpu_bytes), parse_size(args.gpu_bytes)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.rounds <= 0 or min(pages) <= 0 or any(p % 4096 for p in pages):
        raise UsageError("--rounds must be positive and page sizes multiples of 4KiB")
    if min(cpu_bytes, gpu_bytes) < max(pages):
        raise UsageError("--cpu-bytes and --gpu-bytes must hold at least one page")
    import torch  # torch is optional for kvtier; only this subcommand needs it

    result: dict[str, Any] = {"command": "swapin", "settings": {"page_sizes": pages, "rounds": args.rounds}}
    torch.set_num_threads(1)
    if args.formats:
        _formats(args, result, cpu_bytes, gpu_bytes)
    else:
        _pages(args, result, pages, cpu_bytes, gpu_bytes)
    text = json.dumps(result, indent=2)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text if args.json else "\n".join([_table(result), *swapin_format.table(result)]).strip())
    return 0


def _gpu_here() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("tilelang") is not None


def _formats(args: argparse.Namespace, result: dict[str, Any], cpu_bytes: int, gpu_bytes: int) -> None:
    """``--kv-format``: each format's decoding swap-in of ``--model``'s blocks (``swapin_format.py``)."""
    result["settings"] |= {"model": args.model, "kv_formats": args.formats}
    keys = {f: f"{args.model} {f}" for f in args.formats}
    if not args.no_cpu:
        result["cpu_formats"] = {k: swapin_format.cpu(args.model, f, cpu_bytes, args.rounds) for f, k in keys.items()}
    if not args.no_gpu and _gpu_here():
        import torch

        result["gpu_device"] = torch.cuda.get_device_name()
        result["gpu_formats"] = {k: swapin_format.gpu(args.model, f, gpu_bytes, args.rounds) for f, k in keys.items()}


def _pages(args: argparse.Namespace, result: dict[str, Any], pages: list[int], cpu_bytes: int, gpu_bytes: int) -> None:
    import torch

    if not args.no_cpu:
        result["cpu"] = {str(p): _cpu(p, cpu_bytes // p, args.rounds) for p in pages}
        result["settings"]["cpu_bytes"] = cpu_bytes
    if not args.no_gpu and _gpu_here():
        result["gpu_device"] = torch.cuda.get_device_name()
        result["settings"]["gpu_bytes"] = gpu_bytes
        result["gpu"] = {str(p): _gpu(p, gpu_bytes // p, args.rounds) for p in pages}


# --- memory ------------------------------------------------------------------------------------------------------


def _check(what: str, got: Any, want: Any) -> None:
    import torch

    if not torch.equal(got, want):
        raise VerifyError(f"{what}: the destination does not hold the source bytes")


# --- CPU ---------------------------------------------------------------------------------------------------------


def _cpu(page: int, n: int, rounds: int) -> dict[str, Any]:
    with segment(n * page) as (buf, memory):
        times = _cpu_times(buf, page, n, rounds)  # returns holding no view of the segment, so it can close
    gbps = {name: n * page / t / 1e9 for name, t in times.items()}
    baseline = max(gbps["memcpy"], gbps["torch_copy"])
    return {
        "blocks": n,
        "host_memory": memory,
        "gbps": gbps,
        "swap_in_vs_copy": gbps["swap_in"] / baseline,
        "swap_out_vs_copy": gbps["swap_out"] / baseline,
    }


def _cpu_times(buf: memoryview, page: int, n: int, rounds: int) -> dict[str, float]:
    import torch

    from kvtier.kernels.rowcopy import copy_rows_reference
    from kvtier.transfer.swapin import slot_tensor, swap_in, swap_out

    slots = slot_tensor(buf, stride=page, slots=n)
    slots.copy_(torch.randint(0, 256, slots.shape, dtype=torch.uint8))
    cache = torch.empty(2 * n, page, dtype=torch.uint8)
    slot_ids, page_ids = random_ids(n, n, 1), random_ids(n, 2 * n, 2)
    flat_slots, flat_cache = slots.view(-1), cache.view(-1)[: n * page]
    methods = {
        "memcpy": lambda: ctypes.memmove(cache.data_ptr(), slots.data_ptr(), n * page),
        "torch_copy": lambda: flat_cache.copy_(flat_slots),
        "swap_in": lambda: swap_in(slots, slot_ids, cache, page_ids),
        "index_copy": lambda: copy_rows_reference(slots, slot_ids, cache, page_ids),
    }
    for name in ("swap_in", "index_copy"):
        cache.fill_(0xA5)
        methods[name]()
        _check(f"CPU {name}, {format_size(page)} pages", cache[page_ids], slots[slot_ids])
    out_slots = slot_ids.flip(0)
    methods["swap_out"] = lambda: swap_out(cache, page_ids, slots, out_slots)
    slots.fill_(0x5A)
    methods["swap_out"]()
    _check(f"CPU swap_out, {format_size(page)} pages", slots[out_slots], cache[page_ids])
    return median_times(methods, rounds, lambda: None)


# --- GPU ---------------------------------------------------------------------------------------------------------


def _gpu(page: int, n: int, rounds: int) -> dict[str, Any]:
    with segment(n * page) as (buf, memory):
        times = _gpu_times(buf, page, n, rounds)  # returns holding no view of the segment, so it can close
    gbps = {name: n * page / t / 1e9 for name, t in times.items()}
    return {
        "blocks": n,
        "host_memory": memory,
        "gbps": gbps,
        "swap_in_vs_pinned_copy": gbps["swap_in"] / gbps["pinned_copy"],
        "swap_in_grouped_vs_pinned_copy": gbps["swap_in_grouped"] / gbps["pinned_copy"],
        "per_block_vs_pinned_copy": gbps["per_block_memcpy"] / gbps["pinned_copy"],
        "swap_out_vs_pinned_copy": gbps["swap_out"] / gbps["pinned_copy_d2h"],
    }


def _gpu_times(buf: memoryview, page: int, n: int, rounds: int) -> dict[str, float]:
    import torch

    from kvtier.kernels.rowcopy import RowCopyKernel
    from kvtier.transfer.swapin import CudaHostMapping, slot_tensor, swap_in, swap_out

    device = torch.device("cuda")
    slots = slot_tensor(buf, stride=page, slots=n)
    slots.copy_(torch.randint(0, 256, slots.shape, dtype=torch.uint8))
    with CudaHostMapping(slots) as mapping:
        mapped = mapping.tensor
        cache = torch.empty(2 * n, page, dtype=torch.uint8, device=device)
        pinned = torch.empty(n * page, dtype=torch.uint8, pin_memory=True)
        contiguous = torch.empty(n * page, dtype=torch.uint8, device=device)
        slot_ids, page_ids = random_ids(n, n, 1), random_ids(n, 2 * n, 2)
        s_dev, p_dev = slot_ids.to(device), page_ids.to(device)
        rows, clear = torch.stack([s_dev, p_dev]).int(), torch.zeros(1, dtype=torch.int32, device=device)
        slot_rows, cache_rows = slots.unbind(0), cache.unbind(0)
        pairs = list(zip(slot_ids.tolist(), page_ids.tolist(), strict=True))
        words, cache_words = mapped.view(torch.int32), cache.view(torch.int32)

        def per_block() -> None:
            for s, p in pairs:
                cache_rows[p].copy_(slot_rows[s], non_blocking=True)

        per_group = max(1, GROUP_BYTES // page)
        groups = [(slot_ids[i : i + per_group], page_ids[i : i + per_group]) for i in range(0, n, per_group)]

        def grouped() -> None:
            for s, p in groups:
                swap_in(mapped, s, cache, p)

        methods: dict[str, Callable[[], object]] = {
            "pinned_copy": lambda: contiguous.copy_(pinned, non_blocking=True),
            "segment_copy": lambda: contiguous.copy_(slots.view(-1), non_blocking=True),
            "swap_in": lambda: swap_in(mapped, slot_ids, cache, page_ids),
            "swap_in_grouped": grouped,
            "per_block_memcpy": per_block,
        }
        for threads in THREAD_VARIANTS:
            kernel = RowCopyKernel(page // 4, page // 4, page // 4, threads=threads)
            methods[f"kernel_{threads}"] = lambda k=kernel: k(words, rows, cache_words, clear, 1)
        on_device = slots.to(device)  # the truth, to check against without reading the segment again
        for name in ("swap_in", "swap_in_grouped", "per_block_memcpy", *(f"kernel_{t}" for t in THREAD_VARIANTS)):
            cache.fill_(0xA5)
            methods[name]()
            torch.cuda.synchronize()
            _check(f"GPU {name}, {format_size(page)} pages", cache[p_dev], on_device[s_dev])
        out_slots = slot_ids.flip(0)
        methods["swap_out"] = lambda: swap_out(cache, page_ids, mapped, out_slots)
        methods["pinned_copy_d2h"] = lambda: pinned.copy_(contiguous, non_blocking=True)
        slots.fill_(0x5A)
        methods["swap_out"]()
        torch.cuda.synchronize()
        _check(f"GPU swap_out, {format_size(page)} pages", slots[out_slots], cache[page_ids].cpu())
        return median_times(methods, rounds, torch.cuda.synchronize)


# --- report ------------------------------------------------------------------------------------------------------


def _table(result: dict[str, Any]) -> str:
    lines = []
    if "cpu" in result:
        lines += [
            "CPU, one thread (GB/s)",
            "page      memcpy  torch copy_  swap_in  ratio  swap_out  ratio  index_copy_",
        ]
    for page, r in result.get("cpu", {}).items():
        g = r["gbps"]
        lines.append(
            f"{format_size(int(page)):<9} {g['memcpy']:6.2f}  {g['torch_copy']:11.2f}  {g['swap_in']:7.2f}  "
            f"{r['swap_in_vs_copy']:5.2f}  {g['swap_out']:8.2f}  {r['swap_out_vs_copy']:5.2f}  {g['index_copy']:11.2f}"
        )
    if "gpu" in result:
        lines += [
            f"GPU: {result['gpu_device']} (GB/s)",
            "page      swap_in  pinned copy  ratio  grouped  ratio  per-block memcpy  segment copy  "
            "swap_out  d2h copy  ratio  " + "  ".join(f"kernel@{t}" for t in THREAD_VARIANTS),
        ]
        for page, r in result["gpu"].items():
            g = r["gbps"]
            kernels = "  ".join(f"{g[f'kernel_{t}']:9.2f}" for t in THREAD_VARIANTS)
            lines.append(
                f"{format_size(int(page)):<9} {g['swap_in']:7.2f}  {g['pinned_copy']:11.2f}  "
                f"{r['swap_in_vs_pinned_copy']:5.2f}  {g['swap_in_grouped']:7.2f}  "
                f"{r['swap_in_grouped_vs_pinned_copy']:5.2f}  {g['per_block_memcpy']:16.2f}  "
                f"{g['segment_copy']:12.2f}  "
                f"{g['swap_out']:8.2f}  {g['pinned_copy_d2h']:8.2f}  {r['swap_out_vs_pinned_copy']:5.2f}  {kernels}"
            )
    return "\n".join(lines)
