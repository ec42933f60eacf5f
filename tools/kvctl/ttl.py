"""``kvctl ttl show|set|add|remove``: the TTL table, in the cluster file and on the nodes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat as stat_mod
import sys
import tempfile
import tomllib
from pathlib import Path

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvctl.ctl import PROG, Ctl, Refused, UserError, fmt_duration, new_table, user_duration

_HEADER = re.compile(r"^\s*\[")
_TTL_HEADER = re.compile(r"^\s*\[\s*ttl\s*\]\s*(#.*)?$")
_KEY = re.compile(r"""^(\s*)(["']?)([A-Za-z0-9_-]+)\2\s*=\s*("[^"]*"|'[^']*'|[0-9][0-9_.eE+-]*)\s*(#.*)?$""")
_CLASS_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def edit_ttl_table(text: str, action: str, name: str, value: str | None, table: dict[str, float]) -> str:
    """The cluster file ``text`` with one line of its ``[ttl]`` table set, added or removed.

    Every other line is kept byte for byte. ``table`` is the whole new table: written as a new ``[ttl]`` table
    at the end when the file has none (it used the default classes). Raises UserError when the TTL table is not
    a plain ``[ttl]`` table of ``class = "duration"`` lines.
    """
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if _TTL_HEADER.match(line)), None)
    if start is None:
        try:
            has_ttl = "ttl" in tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            has_ttl = True
        if has_ttl:
            raise UserError('cannot edit the TTL table: write it as a [ttl] table with one `class = "3d"` line each')
        tail = "" if not text or text.endswith("\n") else "\n"
        body = "".join(f'{k} = "{fmt_duration(v)}"\n' for k, v in table.items())
        return f"{text}{tail}\n[ttl]\n{body}"
    end = next((j for j in range(start + 1, len(lines)) if _HEADER.match(lines[j])), len(lines))
    found: dict[str, int] = {}
    last = start
    for j in range(start + 1, end):
        stripped = lines[j].strip()
        if not stripped or stripped.startswith("#"):
            continue
        m = _KEY.match(lines[j].rstrip("\r\n"))
        if m is None:
            raise UserError(f'cannot edit the [ttl] table: line {j + 1} is not `class = "duration"`')
        found[m.group(3)] = j
        last = j
    newline = "\r\n" if lines[start].endswith("\r\n") else "\n"
    if action in ("set", "remove") and name not in found:
        raise UserError(f'cannot edit the [ttl] table: no plain `{name} = "duration"` line in it')
    if action == "remove":
        del lines[found[name]]
    elif action == "set":
        j = found[name]
        m = _KEY.match(lines[j].rstrip("\r\n"))
        assert m is not None
        comment = f"  {m.group(5)}" if m.group(5) else ""
        ending = lines[j][len(lines[j].rstrip("\r\n")) :]
        lines[j] = f'{m.group(1)}{m.group(2)}{name}{m.group(2)} = "{value}"{comment}{ending}'
    else:
        if not lines[last].endswith("\n"):
            lines[last] += newline
        lines.insert(last + 1, f'{name} = "{value}"{newline}')
    return "".join(lines)


def _write_atomic(path: Path, text: str) -> None:
    mode = stat_mod.S_IMODE(path.stat().st_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive lock on the cluster file's folder: two kvctl never rewrite the file at once."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _rewrite_ttl(ctl: Ctl, action: str, name: str, value: str | None) -> dict[str, float]:
    """Edit the file under the lock, check it loads with exactly the intended table, replace it; the new table."""
    from kvtier.kvstore import cluster as cluster_mod

    path = Path(os.path.realpath(ctl.path))
    try:
        with _folder_lock(path.parent):
            text = path.read_text()
            try:
                current = cluster_mod.parse(tomllib.loads(text), base_dir=path.parent, path=path).ttl_classes
            except (tomllib.TOMLDecodeError, ValueError) as exc:
                raise UserError(f"cluster file {path} is not valid: {exc}") from None
            want = dict(current)
            if action == "remove":
                if name not in want:
                    raise UserError(f"unknown TTL class {name!r}; classes: {', '.join(want)}")
                del want[name]
            else:
                assert value is not None
                if action == "set" and name not in want:
                    raise UserError(f"unknown TTL class {name!r}; classes: {', '.join(want)} (`ttl add` makes one)")
                if action == "add" and name in want:
                    raise UserError(f"TTL class {name!r} exists already ({fmt_duration(want[name])}); use `ttl set`")
                want[name] = user_duration(value)
            new = edit_ttl_table(text, action, name, value, want)
            try:
                check = cluster_mod.parse(tomllib.loads(new), base_dir=path.parent, path=path).ttl_classes
            except (tomllib.TOMLDecodeError, ValueError) as exc:
                raise UserError(f"editing [ttl] would break {path} ({exc}); it was not changed") from None
            if check != want:
                raise UserError(f"cannot edit the [ttl] table of {path} safely; it was not changed")
            _write_atomic(path, new)
            return want
    except OSError as exc:
        raise UserError(f"cannot rewrite {path}: {exc.strerror or exc}") from None


def cmd_ttl(ctl: Ctl) -> int:
    a = ctl.args
    if a.action == "show":
        return _ttl_show(ctl)
    name = a.cls
    if not _CLASS_NAME.match(name):
        raise UserError(f"bad class name {name!r}: use letters, digits, - and _ (at most 64)")
    value = None
    if a.action in ("set", "add"):
        value = fmt_duration(user_duration(a.duration))
    known = ctl.config.ttl_classes
    if a.action in ("set", "remove") and name not in known:
        raise UserError(f"unknown TTL class {name!r}; classes: {', '.join(known)}")
    if a.action == "add" and name in known:
        raise UserError(f"TTL class {name!r} exists already ({fmt_duration(known[name])}); use `ttl set`")
    ok, down, failed = ctl.infos()  # the admin check, before the file is touched
    if a.action == "remove":
        if len(known) == 1:
            raise Refused(f"refused: {name!r} is the last TTL class; a cluster needs at least one")
        in_use = {nid: int((i.get("classes") or {}).get(name, 0)) for nid, i in ok.items()}
        total = sum(in_use.values())
        if total:
            holders = ", ".join(str(nid) for nid, n in in_use.items() if n)
            raise Refused(
                f"refused: {total} stored blocks are of class {name!r} (primaries: nodes {holders}); "
                f"evict them (`kvctl evict --class {name}`) or let them expire, then remove it"
            )
        unknown = sorted([*down, *failed])
        if unknown and not a.force:
            raise Refused(
                f"refused: node{'s' if len(unknown) > 1 else ''} {', '.join(map(str, unknown))} did not answer, so "
                f"blocks of class {name!r} there cannot be counted; bring them up, or pass --force"
            )
    table = _rewrite_ttl(ctl, a.action, name, value)
    pushed = ctl.client.admin("ttl_set", classes=table)
    applied, down2, failed2 = ctl.sort(pushed)
    result = {
        "action": a.action,
        "class": name,
        "seconds": table.get(name),
        "ttl": table,
        "file": str(ctl.path),
        "applied": sorted(applied),
        "down": down2,
        "failed": {str(k): v for k, v in failed2.items()},
    }
    if ctl.json:
        ctl.emit(result)
    else:
        what = {"set": f"{name} = {value}", "add": f"added {name} = {value}", "remove": f"removed {name}"}[a.action]
        ctl.print(
            f"ttl {what}: {ctl.path} rewritten; {len(applied)} of {len(ctl.config.nodes)} nodes use the new table"
        )
        if down2:
            ctl.print(f"[yellow]down:[/] nodes {', '.join(map(str, down2))} (they read the file when they start)")
    if failed2:
        detail = "; ".join(f"node {n}: {why}" for n, why in failed2.items())
        print(
            f"{PROG}: the file changed but some nodes did not take the new table ({detail}); rerun the command",
            file=sys.stderr,
        )
        return 1
    return 0


def _ttl_show(ctl: Ctl) -> int:
    ok, down, failed = ctl.infos()
    file_table = ctl.config.ttl_classes
    counts: dict[str, int] = {}
    for info in ok.values():
        for name, n in (info.get("classes") or {}).items():
            counts[name] = counts.get(name, 0) + int(n)
    differ = {str(nid): i.get("ttl") for nid, i in ok.items() if i.get("ttl") != file_table}
    result = {
        "ttl": file_table,
        "ttl_human": {k: fmt_duration(v) for k, v in file_table.items()},
        "blocks": {name: counts.get(name, 0) for name in sorted(set(file_table) | set(counts))},
        "nodes_out_of_sync": differ,
        "down": down,
    }
    if ctl.json:
        ctl.emit(result)
        return 0
    table = new_table("class", "ttl", "seconds", "blocks", right=("seconds", "blocks"))
    for name in sorted(set(file_table) | set(counts)):
        if name in file_table:
            table.add_row(name, fmt_duration(file_table[name]), f"{file_table[name]:g}", str(counts.get(name, 0)))
        else:
            table.add_row(f"{name} [red](not in the file)[/]", "-", "-", str(counts[name]))
    ctl.print(table)
    for nid, other in differ.items():
        shown = ", ".join(f"{k} = {fmt_duration(v)}" for k, v in (other or {}).items())
        ctl.print(f"[yellow]node {nid} uses another table:[/] {shown}")
    ctl.warn_down(down, failed)
    return 0


def register(commands: Subcommands) -> None:
    ttl = commands.group("ttl", "show or change TTL classes")
    ttl.add("show", "the TTL table and blocks per class", _ttl_show)
    for action, help_text in (("set", "change a class's TTL"), ("add", "add a class")):
        q = ttl.add(action, help_text, cmd_ttl)
        q.add_argument("cls", metavar="CLASS")
        q.add_argument("duration", metavar="DURATION", help="e.g. 30s, 12h, 3d")
    q = ttl.add("remove", "remove a class no stored block uses", cmd_ttl)
    q.add_argument("cls", metavar="CLASS")
    q.add_argument("--force", action="store_true", help="remove even while some nodes are down")
