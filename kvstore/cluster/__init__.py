"""A cluster and running it: the cluster file (``config``), its map in etcd (``map``, over ``etcd``), membership by
etcd leases (``membership``), a cluster's nodes run and supervised on this host (``local``, ``children``), and the
``kvstore`` command (``cli``). Imports the base and ``wire`` (a cluster's limits are the protocol's); ``node`` and
``client`` read it, and it imports neither (``local`` starts nodes as processes, by module name).

``kvtier.kvstore.cluster`` was the cluster file (now ``cluster.config``): its names still resolve here, with a
warning, for one release.
"""

from kvtier.kvstore._moved import forward

__getattr__ = forward("cluster")
