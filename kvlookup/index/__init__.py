"""The index: the only wing that names a Redis key or sends a command.

One module per Redis concept (rq's shape): ``keys`` builds every key, ``scripts`` holds the Lua,
``store`` is the registry and ingest, ``records`` the seam between the index and the deployment
(single server or Cluster), ``staged``/``walk`` the client-side lookup, ``tracking`` the cached
reads, ``failover`` the heal after a master is replaced, ``fleet`` the registry as readers see it.
"""
