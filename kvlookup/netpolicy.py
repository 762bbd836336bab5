"""Address allow-lists: who may connect to a sidecar, which workers a controller may call.

A list is IP addresses and CIDR networks (``10.0.0.5``, ``10.0.0.0/8``, ``fd00::/8``), or
``*`` for any address, hostnames included. Addresses are compared as literals; nothing is
resolved, so a hostname matches only ``*``.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
ANY = "*"
#: The default of every allow-list: nothing beyond loopback unless configured.
LOOPBACK = ("127.0.0.0/8", "::1")


@dataclass(frozen=True)
class Networks:
    """A parsed allow-list. nets: the networks; any: True for ``*`` (every address)."""

    nets: tuple[IPNetwork, ...] = ()
    any: bool = False

    def __str__(self) -> str:
        return ANY if self.any else ", ".join(str(n) for n in self.nets)


def split_list(value: str | Iterable[object], setting: str) -> list[str]:
    """A list setting as strings: a JSON list, a comma list (``"a, b"``) or a sequence.

    Raises ValueError naming ``setting`` when a JSON list does not parse.
    """
    if isinstance(value, str):
        text = value.strip()
        if not text.startswith("["):
            return [part.strip() for part in text.split(",") if part.strip()]
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{setting}: {text!r} is not a JSON list ({exc})") from None
    if not isinstance(value, Iterable) or isinstance(value, (bytes, dict)):
        raise ValueError(f"{setting}: expected a list, got {value!r}")
    return [str(item).strip() for item in value]


def parse_networks(value: str | Iterable[object], setting: str) -> Networks:
    """Parse an allow-list setting (see :func:`split_list` for the accepted shapes).

    Raises ValueError ``"<setting>: 'abc' is not an IP address or network"``, or one saying
    the list is empty (nothing could ever match).
    """
    items = split_list(value, setting)
    if not items:
        raise ValueError(f"{setting}: the list is empty, so no address would match; give networks, or '*' for any")
    nets = []
    for item in items:
        if item == ANY:
            return Networks(any=True)
        try:
            nets.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            raise ValueError(f"{setting}: {item!r} is not an IP address or network") from None
    return Networks(tuple(nets))


def address_allowed(ip: str, networks: Networks) -> bool:
    """Whether ``ip`` (an IP literal; IPv4-mapped IPv6 counts as IPv4) is in ``networks``.

    A hostname or anything else that is not an IP literal is allowed only by ``*``.
    """
    if networks.any:
        return True
    try:
        addr = ipaddress.ip_address(ip.strip().strip("[]"))
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr in net for net in networks.nets)


LOOPBACK_NETWORKS = parse_networks(LOOPBACK, "default")
