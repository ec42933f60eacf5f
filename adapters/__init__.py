"""kvtier as the external KV store of the engines people run: each module plugs into one engine's own interface.

- :mod:`kvtier.adapters.sglang`: a HiCache storage backend (SGLang's ``--hicache-storage-backend dynamic``);
- :mod:`kvtier.adapters.vllm`: a secondary tier of vLLM's offloading connector (``TieringOffloadingSpec``);
- :mod:`kvtier.adapters.lmcache`: an LMCache remote-storage plugin (``remote_storage_plugins: [kvtier]``).

Each imports without its engine and names the extra to install when used (``pip install 'kvtier[sglang]'``);
:mod:`kvtier.adapters.store` is what they share. Configurations to copy: docs/adapters.md.
"""
