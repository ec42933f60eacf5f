"""The Python packages the lent GPU machine lacks, as one archive that a device call can carry, and the steps that
use it there.

The GPU machine (Python 3.12, torch with CUDA, nvcc; no package index) has no TileLang and none of the few kvtier
dependencies outside its image. As wheels they are over the 64 MiB a call carries; unpacked into one folder and
packed with xz they fit (about 53 MB). Three subcommands::

    python3 dev/gpu_bundle.py build              # here: download the cp312 wheels, write .gpu/bundle.tar.xz
    python3 dev/gpu_bundle.py unpack DEST        # there: unpack into DEST, a folder to put on PYTHONPATH
    python3 dev/gpu_bundle.py device OUT [--runs N] [--bench-args ARGS] [--then SCRIPT]
                                                   # there: unpack, link kvtier's packages, build its C
                                                   # extensions, run the GPU tests, then the swap-in benchmark N
                                                   # times (default 3; ARGS: more of its options, e.g. --no-cpu),
                                                   # then SCRIPT (a sweep of your own, run as `python SCRIPT OUT`
                                                   # with the same imports); output under OUT

The device run, as one ``run`` call (carry ``.gpu``)::

    python3 dev/gpu_bundle.py device $OUT

``build`` needs pip and the package index; ``unpack`` and ``device`` need only the standard library (plus, for
``device``, what the tests and the benchmark import). Each exits non-zero with one ``gpu_bundle: error:`` line
when a step fails.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCHIVE = ROOT / ".gpu" / "bundle.tar.xz"
# TileLang and what it needs beyond the image's torch/numpy; apache-tvm-ffi must stay below 0.1.13 for it.
TILELANG = ["tilelang==0.1.15", "apache-tvm-ffi==0.1.12", "torch-c-dlpack-ext==0.1.5", "z3-solver==4.15.4"]
# kvtier's own dependencies that the GPU image lacks (``import kvtier.transfer`` needs them).
KVTIER = ["crc32c==2.9.post0", "lmdb==3.0.0", "msgspec==0.23.0", "pyeclib==1.8.0", "tomlkit==0.15.2",
          "msgpack==1.2.4", "xxhash==4.1.0", "prometheus_client==0.26.0"]  # fmt: skip
# wheels added since the archive was built (cp312, ``pip download`` them here): unpacked over it, so that a new
# dependency does not mean downloading and packing TileLang again
EXTRA_WHEELS = ROOT / ".gpu" / "wheels"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
GPU_TESTS = ["tests/test_kernels.py", "tests/test_swapin.py", "tests/test_engine_gpu.py"]  # the engine swaps too


class BundleError(Exception):
    pass


def build(archive: Path) -> None:
    """Download the wheels for CPython 3.12 on manylinux x86-64, unzip them into one tree, pack it with xz."""
    with tempfile.TemporaryDirectory() as tmp:
        wheels, tree = Path(tmp, "wheels"), Path(tmp, "site")
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                   "3.12", "--implementation", "cp", *platforms, "-d", str(wheels), *TILELANG, *KVTIER]  # fmt: skip
        if subprocess.run(command).returncode != 0:
            raise BundleError("pip download failed (see its output above)")
        for wheel in sorted(wheels.glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tree)
        _restore_modes(wheels, tree)
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:xz") as tar:
            tar.add(tree, arcname="site")
    print(f"{archive}: {archive.stat().st_size / 1e6:.1f} MB")


def _restore_modes(wheels: Path, tree: Path) -> None:
    """``zipfile`` drops the executable bits that shared libraries and tools (z3, nvcc wrappers) keep in a wheel."""
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                mode = info.external_attr >> 16
                if mode & 0o111:
                    (tree / info.filename).chmod(mode & 0o777)


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack the bundle (and ``EXTRA_WHEELS`` over it); returns the folder to put on ``PYTHONPATH``."""
    if not archive.is_file():
        raise BundleError(f"no bundle at {archive}: run `python3 dev/gpu_bundle.py build` here and carry .gpu")
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="tar")
    site = dest / "site"
    for wheel in sorted(EXTRA_WHEELS.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    _restore_modes(EXTRA_WHEELS, site)
    return site


def link_packages(dest: Path) -> Path:
    """kvtier's import tree (``kvtier.transfer`` → ``transfer/`` …, as pyproject maps it) made of symlinks into this
    checkout, with its C extensions compiled in place for this Python: the device runs the working tree without
    installing it."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = setuptools["package-dir"]
    top = dest / "kvtier"
    top.mkdir(parents=True, exist_ok=True)
    for package, folder in mapping.items():
        source = ROOT / folder
        if package == "kvtier":
            for item in source.iterdir():
                _symlink(top / item.name, item)
        else:
            _symlink(top / package.split(".", 1)[1], source)
    for ext in setuptools.get("ext-modules", []):
        package, module = ext["name"].rsplit(".", 1)
        target = ROOT / mapping[package] / (module + sysconfig.get_config_var("EXT_SUFFIX"))
        sources = [str(ROOT / source) for source in ext["sources"]]
        include = f"-I{sysconfig.get_paths()['include']}"
        command = ["cc", "-shared", "-fPIC", *ext.get("extra-compile-args", []), include, *sources, "-o", str(target)]
        if subprocess.run(command).returncode != 0:
            raise BundleError(f"building {ext['name']} failed: {' '.join(command)}")
    return dest


def _symlink(link: Path, target: Path) -> None:
    if link.is_symlink():
        link.unlink()
    link.symlink_to(target)


def device(out: Path, runs: int = 3, then: Path | None = None, bench_args: str = "") -> int:
    """Everything the GPU run does, output under ``out``: the GPU tests (``tests.log``: the kernels, the swaps and
    the engine's GPU path, which swaps pages in and out), then the swap-in benchmark
    (CPU and GPU) ``runs`` times in a row (``bench.log``, ``swapin-1.json`` …), so that one call shows the spread,
    then ``then`` if given (``then.log``)."""
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-gpu-"))
    site = unpack(ARCHIVE, work)
    packages = link_packages(work / "src")
    env = dict(os.environ, PYTHONPATH=f"{packages}:{site}", PYTHONUNBUFFERED="1")
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-rs", *GPU_TESTS]
    bench = [sys.executable, "-m", "kvtier.tools.kvbench", "swapin", *shlex.split(bench_args), "--json-out"]
    steps = [("tests", pytest)] + [("bench", [*bench, str(out / f"swapin-{i}.json")]) for i in range(1, runs + 1)]
    if then is not None:
        steps.append(("then", [sys.executable, str(then.resolve()), str(out)]))
    failed = 0
    for name, command in steps:
        print(f"== {name}: {' '.join(command)}", flush=True)
        with open(out / f"{name}.log", "a") as log:
            proc = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            failed += proc.wait() != 0
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_bundle", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="download the wheels and write .gpu/bundle.tar.xz")
    sub.add_parser("unpack", help="unpack the bundle into DEST").add_argument("dest", type=Path)
    dev = sub.add_parser("device", help="on the GPU machine: tests and benchmark runs, output under OUT")
    dev.add_argument("out", type=Path)
    dev.add_argument("--runs", type=int, default=3, help="benchmark runs in a row (default 3)")
    dev.add_argument("--bench-args", default="", help='more options for kvbench swapin, e.g. "--no-cpu"')
    dev.add_argument("--then", type=Path, help="a Python script to run last, as `python SCRIPT OUT`")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            build(ARCHIVE)
        elif args.command == "unpack":
            print(unpack(ARCHIVE, args.dest))
        else:
            return device(args.out, args.runs, args.then, args.bench_args)
    except BundleError as err:
        print(f"gpu_bundle: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
