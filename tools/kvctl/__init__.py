"""``kvctl``: the operator's command line for a running kvtier cluster.

    kvctl [--config PATH] [--token-file PATH] [--json] [--timeout S] COMMAND ...

    status                                   cluster summary: nodes up/down, capacity, usage, blocks, codec, TTLs
    nodes                                    per node: address, state, usage, shards, blocks, GC state
    stat KEYHEX                              where a block's 12 shards live, its size, class and times
    match --tokens FILE --model M --dtype D --block-tokens N --layout L [--salt S]
                                             how many leading blocks of a token file are stored
    ttl show                                 the TTL table (cluster file and nodes) and blocks per class
    ttl set CLASS DURATION                   change a class's TTL (applies to blocks already stored)
    ttl add CLASS DURATION                   add a class
    ttl remove CLASS [--force]               remove a class no block uses
    evict [--class C] [--older-than D] [--dry-run]
                                             remove blocks of a class and/or created longer ago than D
    gc run [--repair]                        one GC cycle on every node now; per-node GC stats
    repair [--rebuild]                       restore every block's 12 shards (a GC cycle with repair, all nodes)
    scrub                                    check every shard's crc32c now; rewrite the corrupt ones
    drain NODE [--undo]                      stop NODE taking new shards, repair the others, say when it can go
    top [--interval S] [--count N]           live node usage and request rates (Ctrl-C leaves)
    map                                      (etcd) the cluster map: hosts, nodes, states, groups, repair progress
    host add NAME ADDRESS                    (etcd) a host nodes may live on
    node replace ID --host H [--data-dir D]  (etcd) move a node to host H, empty; repair fills it
    group add --hosts A,B,... [--nodes-per-host N]
                                             (etcd) 12 new nodes as a placement group
    tenant add NAME --token-out PATH         add a tenant; its new token goes to PATH (mode 0600)
    export-client [--out PATH]               the cluster file without its tokens, for client hosts

The cluster file comes from ``--config`` or ``$KVTIER_CONFIG``; the token from ``--token-file PATH`` (mode 0600) or
``$KVTIER_TOKEN``, else the cluster file's ``[cluster] token`` (the admin); never from the command line, where every
user's ``ps`` would show it (``--token`` is refused, saying so). Every command except
``stat`` and ``match`` needs the admin token: the nodes refuse the rest to a tenant. Global options may also
follow the command (``kvctl status --json``).

**Output.** Tables for people; with ``--json`` every command prints one JSON object (``top``: one per refresh,
one per line) and nothing else on stdout.

**TTL changes** (``ttl set/add/remove``) change only the affected class in the cluster file's ``[ttl]`` table
(every comment, the layout and the order of the rest stay as they were; the file is written to a temporary file in
the same folder, fsynced, then renamed over it, under a lock on the folder), then push the whole new table to
every node (admin ``ttl_set``). A node that is down reads the file when it starts. ``ttl remove`` is refused while
any node is primary for blocks of the class, for the last class, and while a node is down (its blocks cannot be
counted; ``--force`` removes anyway: that node's blocks of the class stop being served when it restarts).

**Repair** counts are shard writes, summed over nodes. Nodes repair by themselves too: a block committed
short of shards (a node was down) is owed a repair by its primary, and a node started on an empty data dir
rebuilds what it should hold from its peers; ``repair`` does it all now for every block with a record (any two
lost nodes leave one of its three); ``repair --rebuild`` also scans every node's shards for blocks no record
names any more (written before records were kept on three nodes, or three nodes lost): rebuilt from their
shards, or removed everywhere when fewer than 10 are left.

**Scrub** reads every shard on every node and checks it against its crc32c (the nodes do this by themselves
once per ``gc.scrub_period_s``); corrupt shards are rewritten from the other 11, or owed if that cannot be
done now.

**Draining** (``drain NODE``): the node stops taking new shards (puts of blocks whose primary it is are refused
meanwhile, as for a down primary), then every other node runs a GC cycle with repair, so each block has its
other 11 shards. It is safe to stop the node when no other node of its placement group is down and every other
node finished its repair; kvctl says which. The node keeps the flag with its data: restarted, it still takes no
new shards until ``kvctl drain NODE --undo``. A replacement node (a new, empty data folder) takes shards;
``kvctl repair`` then rewrites the ones it should hold.

Exit status:

- 0: done.
- 1: refused or incomplete: ``ttl remove`` of a class in use, of the last class, or with a node down; ``stat``
  of a key with no block record; ``drain`` when it is not yet safe to stop the node; an admin action that a node
  answered with an error other than being down. One ``kvctl: ...`` line on stderr says why.
- 2: a usage error: bad option, unknown class, bad duration, bad key hex, a missing or invalid cluster file, no
  node reachable, a tenant token on an admin command, a token the nodes reject. One ``kvctl: ...`` line on
  stderr says what to do; never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

from kvtier.tools.cliutil import Parser, Subcommands, report_errors
from kvtier.tools.kvctl import drain, gc, lookup, status, tenant, top, topology, ttl
from kvtier.tools.kvctl.ctl import ENV_CONFIG, LONG_TIMEOUT_S, PROG, Ctl, Refused, UserError

# a new command group: its module, plus one entry here
COMMAND_MODULES = (status, lookup, ttl, gc, drain, top, topology, tenant)


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    g = common.add_argument_group("global options (also accepted before the command)")
    g.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help=f"cluster file (default ${ENV_CONFIG})")
    g.add_argument("--token", default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # refused: see Ctl
    g.add_argument("--token-file", metavar="PATH", default=argparse.SUPPRESS, help="file holding the token (0600)")
    g.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print JSON")
    g.add_argument("--timeout", type=float, metavar="S", default=argparse.SUPPRESS, help="per-request timeout")

    parser = Parser(
        prog=PROG,
        description="Operate a kvtier cluster.",
        epilog=__doc__.split("**Output.**")[0] + __doc__[__doc__.index("Exit status:") :],
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", metavar="PATH", default=None, help=f"the cluster file (default: ${ENV_CONFIG})")
    parser.add_argument("--token", default=None, help=argparse.SUPPRESS)  # refused: see Ctl
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        default=None,
        help="file holding the token (mode 0600; default: $KVTIER_TOKEN, else the cluster file's, the admin)",
    )
    parser.add_argument("--json", action="store_true", default=False, help="print one JSON object instead of tables")
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        default=None,
        help=f"per-request timeout (default: the cluster file's; {LONG_TIMEOUT_S:g} s for gc/repair/drain)",
    )
    parser.set_defaults(long_running=False)
    commands = Subcommands(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"), common)
    for module in COMMAND_MODULES:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run() -> int:
        from kvtier.kvstore.cluster.config import TOKEN_ENV
        from kvtier.kvstore.wire.transport import AuthError

        ctl = Ctl(args)
        try:
            return args.run(ctl)
        except AuthError as exc:
            whose = (
                f"the token in {args.token_file}"
                if args.token_file
                else f"${TOKEN_ENV}"
                if os.environ.get(TOKEN_ENV)
                else f"the token in {args.config or os.environ.get(ENV_CONFIG)}"
            )
            raise UserError(
                f"the nodes rejected {whose} ({exc}): use the cluster file's [cluster] token or a tenant's token"
            ) from None
        except BrokenPipeError:  # stdout closed early (``kvctl ... | head``)
            with contextlib.suppress(OSError):
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keep Python's exit-time flush quiet
            return 1
        finally:
            ctl.close()

    return report_errors(PROG, run, [(UserError, 2, ""), (Refused, 1, "")])
