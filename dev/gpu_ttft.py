"""The engine's GPU run in one device call: ``kvbench ttft`` with a seeded ~8 B checkpoint drawn on the GPU, the
engine's GPU tests, then ``kvbench swapin``; every step's log and JSON under OUT as it goes.

    python3 dev/gpu_ttft.py $OUT                  # on the lent H200 (carry .gpu, built by gpu_bundle.py build)
    .venv/bin/python dev/gpu_ttft.py OUT --rehearse   # here: the same steps on the CPU with the tiny preset
    python3 dev/gpu_ttft.py $OUT --preset v4-h200 --lengths 32768,131072 --hits 0,96   # DeepSeek-V4

Steps (each with its own time limit; a step that fails or runs out is logged and the next one runs):
``env`` (GPU, memory, disks), ``checkpoint`` (``kvtier-engine make-checkpoint --preset 8b --layer-types
sliding,sliding,sliding,full --device cuda``, or ``--preset v4-h200``), ``profile`` (with ``--profile L``: where a
prefill of L tokens spends its GPU time), ``ttft`` (32K and 77K tokens, hits 0/50/90/96 %, bf16, the store's 12
nodes in a folder on /dev/shm when it has room, else /tmp), ``tests`` (tests/test_engine_gpu.py), ``swapin`` (GPU
and CPU). Exits non-zero when any step failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpu_bundle  # a script beside this one: `python dev/gpu_ttft.py` puts dev/ first on sys.path

ROOT = Path(__file__).resolve().parent.parent

ENV = (
    "nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv; free -g; df -h /dev/shm /tmp; nproc; "
    "python3 -c 'import torch; print(torch.__version__, torch.cuda.get_device_name())'"
)


def places() -> tuple[Path, Path, str]:
    """Where the checkpoint (16 GB) and the store's nodes go, and each node's capacity. /dev/shm (RAM: no disk
    write-back) when it has room, else the temp dir; the 12 nodes share what is free past a reserve, 1–4 GiB each."""
    shm, tmp = Path("/dev/shm"), Path(tempfile.gettempdir())
    shm_free = shutil.disk_usage(shm).free if shm.is_dir() else 0
    ckpt = shm if shm_free >= 24 << 30 else tmp
    shm_left = shm_free - (18 << 30 if ckpt == shm else 0)
    nodes = shm if shm_left >= 40 << 30 else tmp
    free = shutil.disk_usage(nodes).free - (4 << 30) - (18 << 30 if ckpt == nodes else 0)
    return ckpt, nodes, f"{max(1 << 30, min(4 << 30, free // 12)) >> 20}MiB"


def step(name: str, command: list[str], out: Path, env: dict[str, str], limit_s: float) -> bool:
    """Run ``command`` (its own process group, killed whole past ``limit_s``), output to stdout and OUT/name.log."""
    print(f"== {name} ({limit_s:.0f} s): {' '.join(command)}", flush=True)
    start = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), True)
        timer = _Deadline(proc, limit_s)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            log.flush()
        rc = proc.wait()
        timer.cancel()
    print(f"== {name}: rc {rc} after {time.monotonic() - start:.1f} s", flush=True)
    return rc == 0


class _Deadline:
    """Kills the process group of ``proc`` (node processes included) once ``limit_s`` has passed."""

    def __init__(self, proc: subprocess.Popen[str], limit_s: float) -> None:
        import threading

        self.timer = threading.Timer(limit_s, self._kill, (proc,))
        self.timer.daemon = True
        self.timer.start()

    @staticmethod
    def _kill(proc: subprocess.Popen[str]) -> None:
        print("== time limit: killing the step's process group", flush=True)
        os.killpg(proc.pid, signal.SIGKILL)

    def cancel(self) -> None:
        self.timer.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_ttft", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--rehearse", action="store_true", help="CPU, tiny preset, short prompts, no bundle")
    parser.add_argument("--lengths", default="32768,77824", help="prompt lengths (default 32768,77824)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--hits", default="0,50,90,96", help="hit ratios in percent (default 0,50,90,96)")
    parser.add_argument("--no-swapin", action="store_true", help="leave out the swap-in benchmark")
    parser.add_argument("--ttft-limit", type=float, default=270, help="seconds for each ttft step (default 270)")
    parser.add_argument("--through", default="client", help="ttft steps, comma-separated: client, fetcher")
    parser.add_argument("--pool", default="24GiB", help="the fetcher's pool for --through fetcher (default 24GiB)")
    parser.add_argument("--no-tests", action="store_true", help="leave out the GPU tests")
    parser.add_argument("--preset", default="8b", help="the checkpoint: 8b (dense, default) or v4-h200 (DeepSeek-V4)")
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared plain vs reuse (16)")
    parser.add_argument("--profile", type=int, default=0, metavar="L", help="also profile a prefill of L tokens")
    args = parser.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    py = sys.executable
    if args.rehearse:
        preset = "v4-tiny" if args.preset.startswith("v4") else "tiny"
        device, dtype, lengths, capacity, chunk = "cpu", "float32", "600,900", "256MiB", "512"
        ckpt_root = root = None
    else:
        work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-"))
        site = gpu_bundle.unpack(gpu_bundle.ARCHIVE, work)
        packages = gpu_bundle.link_packages(work / "src")
        env["PYTHONPATH"] = f"{packages}:{site}"
        device, dtype, preset, lengths = "cuda", "bfloat16", args.preset, args.lengths
        chunk = "4096" if preset.startswith("v4") else "2048"  # V4's step is light: fewer, larger chunks
        ckpt_root, root, capacity = places()
    scratch = Path(tempfile.mkdtemp(prefix="kvtier-ttft-", dir=root))
    env["TMPDIR"] = str(scratch)  # the temporary cluster's nodes live here
    checkpoint = Path(tempfile.mkdtemp(prefix="kvtier-ckpt-", dir=ckpt_root)) / preset
    print(f"== checkpoint {checkpoint}, nodes in {scratch} of {capacity} each", flush=True)
    ok = True
    if not args.rehearse:
        ok &= step("env", ["bash", "-c", ENV], out, env, 30)
    make = [py, "-m", "kvtier.engine.cli", "make-checkpoint", str(checkpoint), "--preset", preset,
            "--device", device]  # fmt: skip
    if not preset.startswith("v4"):  # the dense GPU layout: three sliding layers to one global
        make += ["--layer-types", "sliding,sliding,sliding,full"]
    if step("checkpoint", make, out, env, 150):
        for through in args.through.split(","):
            name = "ttft" if through == "client" else f"ttft-{through}"
            ttft = [py, "-m", "kvtier.tools.kvbench", "ttft", "--checkpoint", str(checkpoint), "--device", device,
                    "--dtype", dtype, "--prompt-tokens", lengths, "--hits", args.hits, "--repeats",
                    str(args.repeats), "--chunk-tokens", chunk, "--node-capacity", capacity, "--through", through,
                    "--pool", args.pool, "--check-tokens", str(args.check_tokens),
                    "--json-out", str(out / f"{name}.json")]  # fmt: skip
            ok &= step(name, ttft, out, env, args.ttft_limit)
        if args.profile:
            profile = [py, "dev/profile_prefill.py", str(checkpoint), "--tokens", str(args.profile)]
            ok &= step("profile", profile, out, env, 120)
    else:
        ok = False
    shutil.rmtree(checkpoint.parent, ignore_errors=True)
    if not args.no_tests:  # after the figures: a call cut short at its limit keeps what it measured
        ok &= step("tests", [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-rs",
                             "tests/test_engine_gpu.py"], out, env, 120)  # fmt: skip
    swapin = [py, "-m", "kvtier.tools.kvbench", "swapin", "--json-out", str(out / "swapin.json")]
    if args.rehearse:
        swapin += ["--cpu-bytes", "16MiB", "--rounds", "1", "--no-gpu"]
    if not args.no_swapin:
        ok &= step("swapin", swapin, out, env, 100)
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
