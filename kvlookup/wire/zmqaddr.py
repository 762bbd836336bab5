"""ZMQ endpoint strings: LMCache writes ``host:port``, ZMQ wants ``tcp://host:port``."""

from __future__ import annotations


def endpoint(address: str) -> str:
    """``tcp://`` endpoint for ``host:port`` or a full ZMQ endpoint.

    ``localhost`` becomes 127.0.0.1 (libzmq binds numeric addresses reliably). Raises
    ValueError when no port is given.
    """
    address = address.strip()
    if "://" not in address:
        address = "tcp://" + address
    scheme, rest = address.split("://", 1)
    if scheme != "tcp":
        return address
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"ZMQ address {address!r} needs host:port")
    if host in ("localhost", ""):
        host = "127.0.0.1"
    return f"tcp://{host}:{port}"


def with_port_offset(address: str, offset: int) -> str:
    """The endpoint with its port increased by ``offset`` (vLLM data-parallel rank r uses port + r)."""
    ep = endpoint(address)
    head, _, port = ep.rpartition(":")
    return f"{head}:{int(port) + offset}"
