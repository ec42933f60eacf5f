"""The folders' one-way doors (README, "Architecture"), checked on the source: every ``kvtier`` import, including
those inside functions, goes the allowed way, and so does every import between the store's rooms (docs/design.md,
"The store's rooms"), type-only ones included; no two modules import each other, directly or around a loop, not
even for a type checker; nothing of kvtier uses a kvstore module's old name; the store imports without torch."""

from __future__ import annotations

import ast
import functools
import importlib.util
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

from kvtier.kvstore._moved import MOVED

ROOT = Path(__file__).resolve().parent.parent
# folder -> the folders its modules may import (besides itself); tools may import everything
ALLOWED = {
    "kvstore": set(),
    "gc": {"kvstore"},
    "transfer": {"kvstore", "gc", "kernels"},
    "engine": {"kvstore", "gc", "transfer", "kernels"},
    "serving": {"kvstore", "gc", "transfer", "engine"},
    "kernels": set(),
    "adapters": {"kvstore", "gc", "transfer"},
    "tools": {"kvstore", "gc", "transfer", "engine", "serving", "kernels", "adapters"},
}
# kvstore's rooms -> the rooms their modules may import besides their own; "kvstore" is the base (keys, codec,
# placement, units, logs, the compiled loops). The package itself (``kvtier.kvstore``: the client's API) sits above
# them all and no room imports it.
ROOMS = {
    "kvstore": set(),
    "kvstore.wire": {"kvstore"},
    "kvstore.cluster": {"kvstore", "kvstore.wire"},
    "kvstore.node": {"kvstore", "kvstore.wire", "kvstore.cluster"},
    "kvstore.client": {"kvstore", "kvstore.wire", "kvstore.cluster"},
}
FRONT = "kvtier.kvstore"
HOST_ENGINES = ("sglang", "vllm", "lmcache")
# what only tests, benchmarks and device runs use: never a module a user of the package can import
HARNESSES = ("dev", "tests", "pytest")


def modules() -> dict[str, Path]:
    """``kvtier.<folder>.<module>`` -> its file, for every module of every folder."""
    found = {}
    for folder in ALLOWED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(("kvtier", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return found


@functools.cache
def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once. CPython 3.11's ``ast`` keeps one recursion counter for every thread
    (gh-106905), and 3.11 parses a traceback's source line to place its carets: a traceback formatted meanwhile on
    a thread an earlier test left in this process made a parse fail with "SystemError: AST constructor recursion
    depth mismatch" (under make test). The source is parsed again then; a real syntax error is raised as it is."""
    source = path.read_text()
    for _ in range(3):
        try:
            return ast.parse(source, str(path))
        except SystemError:
            continue
    return ast.parse(source, str(path))


def runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The kvtier modules ``path`` imports when it runs (``if TYPE_CHECKING:`` blocks are for type checkers)."""
    return kvtier_imports(path, known, type_only=False)


def kvtier_imports(path: Path, known: set[str], type_only: bool = True) -> set[str]:
    """The kvtier modules ``path`` names in an import; ``type_only``: those under ``if TYPE_CHECKING:`` too."""
    tree = parsed(path)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            node.body = node.body if type_only else []
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kvtier."):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                imported.add(submodule if submodule in known or is_module(submodule) else node.module)
        elif isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names if alias.name.startswith("kvtier.")}
    return imported


def is_module(name: str) -> bool:
    """Whether ``name`` is a module of its own (a compiled extension has no ``.py`` to find)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def folder(module: str) -> str:
    return module.split(".")[1]


def room(module: str) -> str:
    """The store's room of a ``kvtier.kvstore`` module (``kvstore`` for the base); the package itself is its own."""
    parts = module.split(".")
    if module == FRONT:
        return FRONT
    return f"kvstore.{parts[2]}" if len(parts) > 3 or f"kvstore.{parts[2]}" in ROOMS else "kvstore"


def test_imports_between_folders_go_one_way() -> None:
    found = modules()
    wrong = [
        f"{name} imports {target}"
        for name, path in found.items()
        for target in sorted(runtime_imports(path, set(found)))
        if folder(target) != folder(name) and folder(target) not in ALLOWED[folder(name)]
    ]
    assert wrong == []


def test_the_stores_rooms_import_one_way() -> None:
    found = modules()
    store = {name: path for name, path in found.items() if folder(name) == "kvstore"}
    wrong = [
        f"{name} ({room(name)}) imports {target} ({room(target)})"
        for name, path in store.items()
        if name != FRONT
        for target in sorted(kvtier_imports(path, set(found)))
        if folder(target) == "kvstore" and room(target) != room(name) and room(target) not in ROOMS[room(name)]
    ]
    assert {room(name) for name in store} == {*ROOMS, FRONT}
    assert wrong == []


def test_nothing_uses_a_kvstore_modules_old_name() -> None:
    old = {f"kvtier.kvstore.{name}" for name in MOVED}
    sources = [*modules().values(), *(p for top in ("tests", "dev", "benchmarks") for p in (ROOT / top).rglob("*.py"))]
    using = [
        f"{path.relative_to(ROOT)} imports {name}"
        for path in sources
        for name in sorted(any_imports(path) | {f"{m}.{n}" for m, n in from_imports(path)})
        if name in old
    ]
    assert using == []


def test_an_old_kvstore_module_name_imports_the_module_it_became_with_a_warning() -> None:
    code = (
        "import warnings\n"
        "warnings.simplefilter('error')\n"
        "from kvtier.kvstore._moved import MovedWarning\n"
        "from kvtier.kvstore.wire import protocol\n"
        "from kvtier.kvstore.cluster import config\n"
        "try:\n"
        "    import kvtier.kvstore.protocol\n"
        "except MovedWarning as exc:\n"
        "    assert 'kvtier.kvstore.wire.protocol' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('no warning')\n"
        "warnings.simplefilter('ignore')\n"
        "import kvtier.kvstore.protocol as old\n"
        "from kvtier.kvstore import cluster\n"
        "from kvtier.kvstore.node import open_node\n"
        "from kvtier.kvstore.node.server import open_node as new_open_node\n"
        "assert old is protocol and cluster.load is config.load and open_node is new_open_node\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]


def test_no_modules_import_each_other() -> None:
    found = modules()
    graph = {name: kvtier_imports(path, set(found)) - {name} for name, path in found.items()}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import cycle: {' -> '.join(exc.args[1])}") from None


def test_no_test_or_device_harness_is_importable_from_kvtier() -> None:
    harnesses = sorted(path.stem for path in (ROOT / "dev").glob("*.py") if path.stem != "__init__")
    packages = {name for name, path in modules().items() if path.name == "__init__.py"}
    shipped = [
        f"{package}.{name}" for package in sorted(packages) for name in harnesses if is_module(f"{package}.{name}")
    ]
    importing = [
        f"{name} imports {target}"
        for name, path in modules().items()
        for target in sorted(any_imports(path))
        if target.split(".")[0] in HARNESSES
    ]
    assert harnesses, "dev/ holds the harnesses"
    assert shipped == []
    assert importing == []


def from_imports(path: Path) -> set[tuple[str, str]]:
    """Every (module, name) of a ``from module import name`` in ``path``."""
    return {
        (node.module or "", alias.name)
        for node in ast.walk(parsed(path))
        if isinstance(node, ast.ImportFrom) and node.level == 0
        for alias in node.names
    }


def any_imports(path: Path) -> set[str]:
    """Every absolute module ``path`` names in an import, kvtier's or not."""
    found = set()
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module or "")
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def test_the_store_imports_without_torch() -> None:
    store = [name for name in modules() if folder(name) in ("kvstore", "gc")]
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'safetensors'):\n"
        "    sys.modules[name] = None  # importing it raises ImportError\n"
        f"for module in {store!r}:\n"
        "    __import__(module)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]


def test_adapters_import_without_their_engines_and_name_the_extra_when_used() -> None:
    adapters = [name for name in modules() if folder(name) == "adapters"]
    code = (
        "import sys\n"
        f"for name in {HOST_ENGINES!r}:\n"
        "    sys.modules[name] = None  # importing it raises ImportError\n"
        f"for module in {adapters!r}:\n"
        "    __import__(module)\n"
        "from kvtier.adapters.hosts import EngineMissing\n"
        "from kvtier.adapters import lmcache, sglang, vllm\n"
        "for cls, extra in ((sglang.KvtierHiCacheStorage, 'sglang'), (vllm.KvtierTier, 'vllm'),\n"
        "                   (lmcache.KvtierConnectorAdapter, 'lmcache')):\n"
        "    try:\n"
        "        cls()\n"
        "    except EngineMissing as exc:\n"
        "        assert f\"pip install 'kvtier[{extra}]'\" in str(exc), exc\n"
        "    else:\n"
        "        raise AssertionError(f'{cls.__name__} was made without its engine')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]


def test_the_engine_api_imports_from_the_package_root() -> None:
    code = (
        "from kvtier.engine import Engine, PromptError, Result\n"
        "assert Engine.from_pretrained and issubclass(PromptError, ValueError) and Result\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]


def test_importing_the_store_does_not_import_torch() -> None:
    code = "import sys, kvtier.kvstore, kvtier.kvstore.client, kvtier.gc\nprint('torch' in sys.modules)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
