"""The numeric baseline: per sample, prompt ids → greedy tokens and logit checksums, for the tiny checkpoint
built by seed. Checked in (``tests/data/engine_baseline.json``); any numeric change to the model, the
checkpoint writer or the decoding path shows up as a difference. Refreshing is explicit:
``kvtier-engine baseline --refresh``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.checkpoint import make_checkpoint, model_id
from kvtier.engine.engine import Engine

DEFAULT_FILE = Path(__file__).resolve().parent.parent / "tests" / "data" / "engine_baseline.json"
PRESET, SEED = "tiny", 0
PROMPT_LENGTHS = (3, 64, 300, 700, 1300, 2100)
NEW_TOKENS = 16
CHECKSUM_TOLERANCE = 1e-4  # relative, on sums over thousands of logits


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def checksums(logits: torch.Tensor) -> dict[str, float]:
    """Sum, sum of squares and the first row's sum: change any logit by more than rounding and they move."""
    x = logits.double()
    return {"sum": x.sum().item(), "sum_sq": x.pow(2).sum().item(), "first_row_sum": x[0].sum().item()}


def samples(engine: Engine, reuse: bool = False, results: list[Any] | None = None) -> list[dict[str, Any]]:
    """One record per baseline prompt: greedy tokens (through ``generate``) and checksums of the full-forward
    logits of prompt + tokens, plus the first token's logits checksums from the cached path. ``results``, if
    given, receives ``generate``'s results (what reuse did per sample)."""
    out = []
    generated = engine.generate(ps := prompts(engine.config.vocab_size), NEW_TOKENS, reuse)
    if results is not None:
        results.extend(generated)
    for prompt, result in zip(ps, generated, strict=True):
        out.append(
            {
                "prompt": prompt,
                "tokens": result.tokens,
                "logits": checksums(engine.logits(prompt + result.tokens)),
                "first_logits": checksums(result.first_logits[None]),
            }
        )
    return out


def build(workdir: Path) -> tuple[Path, dict[str, Any]]:
    """Write the seeded checkpoint under ``workdir``; returns its path and the baseline's header."""
    path = make_checkpoint(workdir / PRESET, PRESET, seed=SEED)
    return path, {"preset": PRESET, "seed": SEED, "model_id": model_id(path), "new_tokens": NEW_TOKENS}


def refresh(file: Path = DEFAULT_FILE) -> Path:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path, header = build(Path(tmp))
        data = {**header, "samples": samples(Engine.from_pretrained(path))}
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps(data, indent=1) + "\n")
    return file


def differences(expected: dict[str, Any], header: dict[str, Any], got: list[dict[str, Any]]) -> list[str]:
    """What differs between the checked-in baseline and a fresh run, one line each (empty: none)."""
    diffs = [f"{k}: baseline {expected.get(k)!r}, now {v!r}" for k, v in header.items() if expected.get(k) != v]
    for i, (want, have) in enumerate(zip(expected["samples"], got, strict=True)):
        if want["prompt"] != have["prompt"]:
            diffs.append(f"sample {i}: prompt differs (the prompt generator changed)")
        if want["tokens"] != have["tokens"]:
            diffs.append(f"sample {i}: tokens {want['tokens']} → {have['tokens']}")
        for part in ("logits", "first_logits"):
            for k, w in want[part].items():
                h = have[part][k]
                if abs(h - w) > CHECKSUM_TOLERANCE * max(1.0, abs(w)):
                    diffs.append(f"sample {i}: {part}.{k} {w!r} → {h!r}")
    return diffs


def check(file: Path = DEFAULT_FILE) -> list[str]:
    torch.set_num_threads(1)
    expected = json.loads(file.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        path, header = build(Path(tmp))
        return differences(expected, header, samples(Engine.from_pretrained(path)))
