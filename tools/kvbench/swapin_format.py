"""``kvbench swapin --kv-format F``: the decoding swap-in of a model's real blocks in a KV format, against the link at
the encoded byte count and against today's swap-in of the same blocks undecoded, measured in the same run.

The blocks are the layout a preset (``--model``: ``8b``, ``v4-h200``, …, as ``kv-bytes`` names them) has in format
``F`` (``engine/formats.py``): ``n`` blocks of ``--gpu-bytes`` encoded bytes in all, random bytes (every element and
scale code, NaN and the scale's range ends among them: the decoder takes any bytes), one slot each of a real shared
memory segment registered with CUDA, decoded into a paged cache of ``2n`` bfloat16 pages on the device, slot ``b`` to
a random page. Every method runs once untimed and is checked bit for bit against the torch reference decode (on the
device), then ``--rounds`` times interleaved (medians):

- ``swap_in``: ``swap_in(..., decode=)``: the TileLang decoding gather reads the encoded slots across PCIe (target:
  ≥ 0.9 of ``pinned_copy``);
- ``pinned_copy``: one contiguous ``cudaMemcpyAsync`` of the same encoded bytes from pinned memory: the link;
- ``copy_then_decode``: that copy into device memory, then the decoding gather reading device memory (what a decode
  after a copy-engine transfer would cost; a bound, as the slots are contiguous here);
- ``swap_in_decoded``: today's swap-in (the row copy) of the decoded pages from a segment of decoded slots (2–4x
  the bytes): the time a hit's swap-in took before formats.

GB/s are of encoded bytes; ``swap_in_vs_pinned_copy`` and ``swap_in_decoded_vs_swap_in`` (the time ratio: how much
faster the hit's swap-in got) are reported. On the CPU: ``swap_in`` (torch's decode) against one ``memcpy`` of the
encoded bytes, for the record.
"""

from __future__ import annotations

import ctypes
from typing import Any

from kvtier.tools.kvbench.common import UsageError, VerifyError
from kvtier.tools.kvbench.kvbytes import model
from kvtier.tools.kvbench.swapmem import median_times, random_ids, segment


def layout(model_name: str, kv_format: str, dtype: Any) -> Any:
    """The model's block layout in ``kv_format`` (``formats.Layout``); UsageError (one line) if it cannot take it."""
    from kvtier.engine.formats import FormatError, KVFormat

    family, config = model(model_name)
    block_tokens = family.block_tokens(config, None)
    try:
        form = KVFormat.parse(kv_format).layout(family.kv_parts(config, block_tokens, dtype)[0], dtype, "blocks")
    except FormatError as e:
        raise UsageError(str(e)) from None
    if form.identity:
        raise UsageError(f"--kv-format {kv_format}: blocks are stored as they are; nothing to decode")
    return form


def describe(form: Any, n: int) -> dict[str, Any]:
    return {"blocks": n, "block_bytes": form.encoded_bytes, "page_bytes": form.decoded_bytes}


def gpu(model_name: str, kv_format: str, nbytes: int, rounds: int) -> dict[str, Any]:
    import torch

    form = layout(model_name, kv_format, torch.bfloat16)
    n = max(1, nbytes // form.encoded_bytes)
    stride = -(-form.encoded_bytes // 4096) * 4096
    with segment(n * stride) as (buf, memory), segment(n * form.decoded_bytes) as (plain, _):
        times = _gpu_times(form, buf, plain, stride, n, rounds)
    gbps = {name: n * form.encoded_bytes / t / 1e9 for name, t in times.items()}
    return {
        **describe(form, n),
        "host_memory": memory,
        "gbps": gbps,
        "swap_in_vs_pinned_copy": gbps["swap_in"] / gbps["pinned_copy"],
        "copy_then_decode_vs_pinned_copy": gbps["copy_then_decode"] / gbps["pinned_copy"],
        "swap_in_decoded_vs_swap_in": times["swap_in_decoded"] / times["swap_in"],
    }


def _gpu_times(form: Any, buf: memoryview, plain: memoryview, stride: int, n: int, rounds: int) -> dict[str, float]:
    import torch

    from kvtier.transfer.swapin import CudaHostMapping, slot_tensor, swap_in

    device, decoder = torch.device("cuda"), form.decoder
    slots = slot_tensor(buf, stride=stride, slots=n)
    slots.copy_(torch.randint(0, 256, slots.shape, dtype=torch.uint8))
    decoded_slots = slot_tensor(plain, stride=form.decoded_bytes, slots=n)
    decoded_slots.copy_(torch.randint(0, 256, decoded_slots.shape, dtype=torch.uint8))
    with CudaHostMapping(slots) as mapping, CudaHostMapping(decoded_slots) as decoded_mapping:
        cache = torch.empty(2 * n, form.decoded_bytes // 2, dtype=torch.bfloat16, device=device)
        pinned = torch.empty(n, form.encoded_bytes, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(slots[:, : form.encoded_bytes])
        on_device = torch.empty(n, form.encoded_bytes, dtype=torch.uint8, device=device)
        slot_ids, page_ids = random_ids(n, n, 1), random_ids(n, 2 * n, 2)
        in_order = torch.arange(n)

        def copy_then_decode() -> None:
            on_device.copy_(pinned, non_blocking=True)
            swap_in(on_device, in_order, cache, page_ids, decode=decoder)

        methods = {
            "swap_in": lambda: swap_in(mapping.tensor, slot_ids, cache, page_ids, decode=decoder),
            "pinned_copy": lambda: on_device.copy_(pinned, non_blocking=True),
            "copy_then_decode": copy_then_decode,
            "swap_in_decoded": lambda: swap_in(decoded_mapping.tensor, slot_ids, cache, page_ids),
        }
        rows = cache.view(2 * n, -1).view(torch.uint8)
        truth = decoder.reference(slots.to(device))  # the reference decode of every slot, on the device
        for name, source in (("swap_in", slot_ids), ("copy_then_decode", in_order)):
            rows.fill_(0xA5)
            methods[name]()
            torch.cuda.synchronize()
            if not torch.equal(rows[page_ids.to(device)], truth[source.to(device)]):
                raise VerifyError(f"GPU {name} in {form.kv_dtype}: the pages are not the reference decode")
        return median_times(methods, rounds, torch.cuda.synchronize)


def cpu(model_name: str, kv_format: str, nbytes: int, rounds: int) -> dict[str, Any]:
    import torch

    form = layout(model_name, kv_format, torch.float32)
    n = max(1, nbytes // form.encoded_bytes)
    with segment(n * form.encoded_bytes) as (buf, memory):
        times = _cpu_times(form, buf, n, rounds)  # returns holding no view of the segment, so it can close
    gbps = {name: n * form.encoded_bytes / t / 1e9 for name, t in times.items()}
    ratio = gbps["swap_in"] / gbps["memcpy"]
    return {**describe(form, n), "host_memory": memory, "gbps": gbps, "swap_in_vs_memcpy": ratio}


def _cpu_times(form: Any, buf: memoryview, n: int, rounds: int) -> dict[str, float]:
    import torch

    from kvtier.transfer.swapin import slot_tensor, swap_in

    slots = slot_tensor(buf, stride=form.encoded_bytes, slots=n)
    slots.copy_(torch.randint(0, 256, slots.shape, dtype=torch.uint8))
    cache = torch.empty(2 * n, form.decoded_bytes, dtype=torch.uint8)
    target = torch.empty(n * form.encoded_bytes, dtype=torch.uint8)
    slot_ids, page_ids = random_ids(n, n, 1), random_ids(n, 2 * n, 2)
    methods = {
        "memcpy": lambda: ctypes.memmove(target.data_ptr(), slots.data_ptr(), n * form.encoded_bytes),
        "swap_in": lambda: swap_in(slots, slot_ids, cache, page_ids, decode=form.decoder),
    }
    return median_times(methods, rounds, lambda: None)


def table(result: dict[str, Any]) -> list[str]:
    """The formats' part of ``kvbench swapin``'s table."""
    lines = []
    for where, fields in (
        ("gpu", ["swap_in", "pinned_copy", "copy_then_decode", "swap_in_decoded"]),
        ("cpu", ["swap_in", "memcpy"]),
    ):
        for key, r in result.get(f"{where}_formats", {}).items():
            g = r["gbps"]
            figures = "  ".join(f"{name} {g[name]:.2f}" for name in fields)
            ratio = (
                f"swap_in/link {r['swap_in_vs_pinned_copy']:.3f}, copy+decode/link "
                f"{r['copy_then_decode_vs_pinned_copy']:.3f}, undecoded swap-in time / swap_in "
                f"{r['swap_in_decoded_vs_swap_in']:.2f}x"
                if where == "gpu"
                else f"swap_in/memcpy {r['swap_in_vs_memcpy']:.3f}"
            )
            lines.append(
                f"{where.upper()} {key}: {r['blocks']} blocks of {r['block_bytes']:,} B encoded ({r['page_bytes']:,} B "
                f"pages), GB/s of encoded bytes: {figures}; {ratio}"
            )
    return lines
