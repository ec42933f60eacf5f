"""``kvctl tenant add NAME --token-out PATH`` and ``kvctl export-client``: tenants and what clients are given.

A tenant is a ``[tenants.NAME]`` table with a token made here (``cluster.config.new_token``: 256 bits from ``secrets``);
the token goes to a new file of mode 0600 for the tenant's engines and fetchers (``--token-file``), never to the
terminal. Nodes, the directory and fetchers serving every tenant read the table when they start, so they admit
the tenant once restarted. ``export-client`` writes the cluster file without its tokens (``cluster.public.toml``,
also kept in step by every kvctl edit): with a tenant's token file, all a client host needs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvtier.tools.cliutil import Subcommands
from kvtier.tools.kvctl.ctl import Ctl, UserError


def _write_token_file(path: Path, token: str) -> None:
    """A new file holding ``token``, mode 0600 from the start; UserError if it exists or cannot be made."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise UserError(f"{path} exists already; choose another --token-file (it is never overwritten)") from None
    except OSError as exc:
        raise UserError(f"cannot create {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


def cmd_tenant_add(ctl: Ctl) -> int:
    from kvtier.kvstore.cluster import config as cluster_mod

    name, out = ctl.args.name, Path(ctl.args.token_out)
    try:
        cluster_mod.check_tenant_name(name)
        if name == cluster_mod.DEFAULT_TENANT or name in ctl.config.tenants:
            raise UserError(f"tenant {name!r} exists already")
        token = cluster_mod.new_token()
        _write_token_file(out, token)
        try:
            with cluster_mod.edit(ctl.path) as doc:
                doc.setdefault("tenants", {})[name] = {"token": token}
        except BaseException:
            with contextlib.suppress(OSError):
                out.unlink()
            raise
    except cluster_mod.ConfigError as exc:
        raise UserError(str(exc)) from None
    result = {"tenant": name, "token_file": str(out), "file": str(ctl.path)}
    if ctl.json:
        ctl.emit(result)
    else:
        ctl.print(
            f"added tenant {name} to {ctl.path}; its token is in {out} (mode 0600). Restart the nodes, the directory "
            "and fetchers serving every tenant to admit it"
        )
    return 0


def cmd_export_client(ctl: Ctl) -> int:
    from kvtier.kvstore.cluster import config as cluster_mod

    try:
        target = cluster_mod.write_public(ctl.path, out=ctl.args.out)
    except cluster_mod.ConfigError as exc:
        raise UserError(str(exc)) from None
    if ctl.json:
        ctl.emit({"client_file": str(target), "file": str(ctl.path)})
    else:
        ctl.print(f"wrote {target}: {ctl.path} without its tokens; give clients a tenant's token file with it")
    return 0


def register(commands: Subcommands) -> None:
    tenant = commands.group("tenant", "add tenants (each with its own token)")
    q = tenant.add("add", "add a tenant with a new token, written to a new 0600 file", cmd_tenant_add)
    q.add_argument("name", metavar="NAME", help="ASCII letters, digits, - and _")
    q.add_argument("--token-out", metavar="PATH", required=True, help="new file for the tenant's token (mode 0600)")
    q = commands.add("export-client", "write the token-free client file (cluster.public.toml)", cmd_export_client)
    q.add_argument("--out", metavar="PATH", help="where (default: cluster.public.toml beside the cluster file)")
