"""Which addresses the control plane may contact as Triton nodes: a node's URL is data anyone
with the operator role can set, so without this it would be a way to make our servers call
anything they can reach (a cloud metadata service, an admin port on a neighbour)."""

import functools
import socket
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from urllib.parse import urlsplit

from django.conf import settings

from apps.fleet.errors import FleetError

# Never contacted, whatever NODE_ALLOWED_NETWORKS says: "this network", link-local (where cloud
# metadata services answer), AWS's IPv6 metadata address, multicast.
NEVER = tuple(
    ip_network(n)
    for n in (
        "0.0.0.0/8",
        "169.254.0.0/16",
        "224.0.0.0/4",
        "fe80::/10",
        "fd00:ec2::254/128",
        "ff00::/8",
    )
)


@functools.cache
def _allowed(networks: tuple[str, ...]) -> tuple[object, ...]:
    return tuple(ip_network(n, strict=False) for n in networks)


class Refused(Exception):
    """A node's host may not be contacted; the message says why."""


def refusal(host: str) -> str:
    """Why `host` may not be contacted as a node, or "" when it may: every address it resolves
    to lies in NODE_ALLOWED_NETWORKS, and none is link-local, multicast or a metadata address."""
    try:
        pinned(host)
    except Refused as exc:
        return str(exc)
    return ""


def pinned(host: str) -> str:
    """The address to connect to for `host`, checked as `refusal` says: the caller connects to
    it, not to the name, so a name that resolves anew (DNS rebinding) cannot lead elsewhere
    between the check and the connection. Raises Refused."""
    try:
        found = _lookup(host)
    except OSError as exc:
        raise Refused(f"{host} does not resolve ({exc.strerror or exc})") from None
    allowed = _allowed(tuple(settings.NODE_ALLOWED_NETWORKS))
    for text in sorted(set(found)):
        address: IPv4Address | IPv6Address = ip_address(text)
        if isinstance(address, IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        if any(address in network for network in NEVER):
            raise Refused(
                f"{host} is {address}: link-local, multicast and metadata addresses are refused"
            )
        if not any(address in network for network in allowed):  # type: ignore[operator]
            networks = ", ".join(settings.NODE_ALLOWED_NETWORKS)
            raise Refused(f"{host} is {address}, outside NODE_ALLOWED_NETWORKS ({networks})")
    if not found:
        raise Refused(f"{host} does not resolve")
    return found[0]  # in the resolver's order of preference


def _lookup(host: str) -> list[str]:
    """Every address `host` resolves to (itself, for an address), the resolver's first first."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]).split("%")[0] for info in infos))


def validate_url(url: str, *, field: str) -> None:
    """http(s) with a host and a port, and no credentials: they would end up in logs and pages;
    at an address the control plane may contact (`refusal`)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise FleetError(f"{field} {url!r}: the port is not a number from 1 to 65535") from None
    if parts.scheme not in ("http", "https", "grpc"):
        raise FleetError(f"{field} {url!r}: use http:// or https://")
    if parts.username or parts.password:
        raise FleetError(f"{field} {url!r}: no credentials in node addresses")
    if not parts.hostname:
        raise FleetError(f"{field} {url!r}: a host is required")
    if port is None and parts.scheme == "grpc":
        raise FleetError(f"{field} {url!r}: host:port is required")
    refused = refusal(parts.hostname)
    if refused:
        raise FleetError(f"{field} {url!r}: {refused}")
