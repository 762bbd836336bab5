"""Tools for trying kvlookup and for its tests and benchmarks: the demo, a simulated LMCache
worker, a Redis Cluster and a Sentinel group on loopback. No service imports this wing."""
