"""AllowedHosts: where the engine may connect for weight transfer (WeightTransferConfig.weight_transfer_allowed_hosts).

A backend's init_info names the trainer's address (nccl: master_address) and the engine connects
out to it, so an unchecked one lets anyone who can reach the RL routes point the engine at any
host. Entries are host names (matched by name, case-insensitively), IP addresses, CIDR networks
(10.0.0.0/8) or "*" (any host). An address passes when:

    "*" is listed                                      (it must still be well formed and resolve)
    it is an IP address inside a listed address or network
    it is a host name that is listed                   (then it must resolve)
    it is a host name whose every resolved address is inside a listed address or network

check() decides what it can without DNS (it never blocks: it runs on the engine's busy loop);
check_resolved() resolves a host name, which may block, so it runs with the rendezvous, off
the busy loop, and always before any connection is attempted.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
FLAG = "--weight-transfer-allowed-hosts"
FIELD = "weight_transfer_allowed_hosts"

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


def is_host_name(text: str) -> bool:
    """Whether `text` is a syntactically valid DNS host name (RFC 1123 labels; "_" tolerated)."""
    name = text[:-1] if text.endswith(".") else text
    return 0 < len(name) <= 253 and all(_LABEL.match(label) for label in name.split("."))


def _ip(text: str) -> IPAddress | None:
    """`text` as an IP address (IPv4-mapped IPv6 addresses as their IPv4 one), or None."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(frozen=True)
class AllowedHosts:
    """A parsed weight_transfer_allowed_hosts list (see the module docstring for the rules)."""

    entries: tuple[str, ...]
    any_host: bool
    names: frozenset[str]  # lower case, without a trailing dot
    networks: tuple[IPNetwork, ...]  # a listed IP address is a network of one

    @classmethod
    def parse(cls, entries: Iterable[str], where: str = FIELD) -> AllowedHosts:
        """Checks every entry; ValueError naming `where` and the bad entry."""
        if isinstance(entries, str) or not isinstance(entries, Iterable):
            raise ValueError(f"{where}: expected a list of host names, IP addresses, CIDR networks or '*', got {entries!r}")
        entries = tuple(entries)
        names: set[str] = set()
        networks: list[IPNetwork] = []
        for entry in entries:
            if not isinstance(entry, str) or not entry.strip():
                raise ValueError(f"{where}: {entry!r} is not a host name, IP address, CIDR network or '*'")
            entry = entry.strip()
            if entry == "*":
                continue
            if "/" in entry:
                try:
                    networks.append(ipaddress.ip_network(entry, strict=False))
                except ValueError as e:
                    raise ValueError(f"{where}: {entry!r} is not a CIDR network ({e})") from None
            elif (address := _ip(entry)) is not None:
                networks.append(ipaddress.ip_network(address))
            elif is_host_name(entry):
                names.add(entry.lower().rstrip("."))
            else:
                raise ValueError(f"{where}: {entry!r} is not a host name, IP address, CIDR network or '*'")
        return cls(entries, "*" in (e.strip() for e in entries), frozenset(names), tuple(networks))

    def _contains(self, address: IPAddress) -> bool:
        return any(address.version == net.version and address in net for net in self.networks)

    def _refusal(self, where: str, host: str, detail: str = "") -> ValueError:
        return ValueError(f"{where}: {host}{detail} is not in {FIELD} {list(self.entries)} ({FLAG})")

    def check(self, host: object, where: str) -> None:
        """ValueError (naming `where`) unless `host` is well formed and may pass; never resolves a name.

        A host name that only a listed network could let pass is left to check_resolved."""
        if not isinstance(host, str) or not host.strip():
            raise ValueError(f"{where}: expected a host name or IP address, got {host!r}")
        address = _ip(host)
        if address is None and not is_host_name(host):
            raise ValueError(f"{where}: {host!r} is not a host name or IP address")
        if self.any_host:
            return
        if address is not None:
            if not self._contains(address):
                raise self._refusal(where, host)
        elif host.lower().rstrip(".") not in self.names and not self.networks:
            raise self._refusal(where, host)

    def check_resolved(self, host: str, where: str) -> None:
        """check(), then resolves a host name (this may block on DNS: never call it on the busy loop).

        ValueError when the name does not resolve, or when it is not listed itself and one of
        its addresses is outside the list."""
        self.check(host, where)
        if _ip(host) is not None:
            return
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as e:
            raise ValueError(f"{where}: cannot resolve {host!r} ({e})") from None
        if self.any_host or host.lower().rstrip(".") in self.names:
            return
        for info in infos:
            address = _ip(info[4][0].split("%", 1)[0])
            if address is None or not self._contains(address):
                raise self._refusal(where, host, f" (which resolves to {info[4][0]})")
