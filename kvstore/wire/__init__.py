"""How kvtier's processes talk, whoever they are: frames and their sans-IO reader (``protocol``), a batch's keys,
indices and statuses as metadata fields (``fields``), the storage node's request schemas (``requests``), socket
I/O (``sockio``), the client's transport (``transport``), who a server lets in (``admission``), and a process's
metrics endpoint (``metrics``). Imports only the base: the node, the client, the fetcher and the directory build on
it.

``kvtier.kvstore.wire`` was the batch fields module (now ``wire.fields``): its names still resolve here, with a
warning, for one release.
"""

from kvtier.kvstore._moved import forward

__getattr__ = forward("wire")
