"""What the engine benchmarks (``ttft``, ``swa-replay``) share: their model and cluster options, and a run's
checkpoint + cluster (a seeded preset and a temporary local cluster unless given). torch is imported only
when a run starts: kvbench's other commands work without it."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvtier.kvstore.cluster import config as cluster_mod
from kvtier.kvstore.cluster.local import LocalCluster
from kvtier.kvstore.units import parse_size

PRESETS = ("tiny", "small", "1b", "8b")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", type=Path, help="a Hugging Face model directory (default: a seeded preset)")
    p.add_argument("--preset", choices=PRESETS, default="tiny", help="seeded checkpoint to build (tiny)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--node-capacity", default="2GiB", help="each node's capacity in the temporary cluster (2GiB)")


def describe(args: argparse.Namespace) -> str:
    return str(args.checkpoint or f"preset {args.preset} seed {getattr(args, 'seed', 0)}")


@contextlib.contextmanager
def checkpoint_and_cluster(args: argparse.Namespace, prefix: str, seed: int = 0) -> Iterator[tuple[Path, Path, Path]]:
    """``(checkpoint, cluster file, scratch directory)`` for one run (the preset's weights drawn from ``seed``);
    what it started stops on exit."""
    import torch

    from kvtier.engine.checkpoint import make_checkpoint

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        scratch = Path(tmp)
        checkpoint = args.checkpoint or make_checkpoint(scratch / args.preset, args.preset, seed=seed)
        config = getattr(args, "config", None)
        if config is not None:
            yield checkpoint, Path(config), scratch
            return
        capacity = parse_size(args.node_capacity)
        path = cluster_mod.write_default(scratch / "cluster", capacity_bytes=capacity, metrics=False)
        with LocalCluster(path) as local:
            yield checkpoint, local.config_path, scratch
