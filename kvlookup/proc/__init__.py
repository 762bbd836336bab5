"""Processes: the embedded Redis and its keeper, supervision of children, locks, ports, the
gunicorn runner."""
