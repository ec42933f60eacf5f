"""Several GPU measurements in one device call over one seeded checkpoint: the bundle unpacked and kvtier linked as
``gpu_ttft.py`` does, the checkpoint made once, then each step a command run from the repository root with its own
time limit (``{ckpt}`` in a step stands for the checkpoint, ``{out}`` for OUT, ``{py}`` for this Python); every
step's output under OUT as it goes, and a step that fails or runs out does not stop the next.

    python3 dev/gpu_steps.py $OUT --preset 8b --step 'serve:240:{py} benchmarks/serve_ttft_bench.py --checkpoint {ckpt}'
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import gpu_bundle  # scripts beside this one: `python dev/gpu_steps.py` puts dev/ first on sys.path
from gpu_ttft import ENV, places, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--preset", default="8b", help="the checkpoint's preset (default 8b)")
    parser.add_argument("--layer-types", default="sliding,sliding,sliding,full", help="dense presets' layer mix")
    parser.add_argument("--step", action="append", default=[], metavar="NAME:LIMIT_S:COMMAND", help="repeatable")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-"))
    site = gpu_bundle.unpack(gpu_bundle.ARCHIVE, work)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=f"{gpu_bundle.link_packages(work / 'src')}:{site}")
    ckpt_root, root, _ = places()
    env["TMPDIR"] = tempfile.mkdtemp(prefix="kvtier-steps-", dir=root)
    checkpoint = Path(tempfile.mkdtemp(prefix="kvtier-ckpt-", dir=ckpt_root)) / args.preset
    py = sys.executable
    ok = step("env", ["bash", "-c", ENV], args.out, env, 30)
    make = [
        py,
        "-m",
        "kvtier.engine.cli",
        "make-checkpoint",
        str(checkpoint),
        "--preset",
        args.preset,
        "--device",
        "cuda",
    ]
    if not args.preset.startswith("v4"):
        make += ["--layer-types", args.layer_types]
    if not step("checkpoint", make, args.out, env, 150):
        return 1
    for spec in args.step:
        name, limit, command = spec.split(":", 2)
        command = command.format(ckpt=checkpoint, out=args.out, py=py)
        ok &= step(name, ["bash", "-c", command], args.out, env, float(limit))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
