"""Which ``Host`` the viewer answers for, and the socket it listens on.

A page on another site can make the browser send its requests to the viewer through a name of the attacker's
that resolves to this machine (DNS rebinding): the browser then lets that page read the answers (the store's
images and activations). Such a request carries the attacker's name as its ``Host``, so the app answers only for
the names it listens on: the address it bound (and ``localhost`` when that is a loopback address), the name it
was given (``--host``), and, bound to every address (``0.0.0.0``, ``::``), any IP address and this machine's
own names (a rebinding needs a name of the attacker's; an address in the ``Host`` cannot be one).
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from dataclasses import dataclass

from ..errors import ExtractorError

__all__ = ["LOOPBACK", "Hosts", "check_port", "listen"]

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _address(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``name`` as an IP address, or None when it is a name."""
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def host_name(header: str) -> str:
    """A ``Host`` header's name, without its port, in lower case (``[::1]:8050`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 address, bracketed before its port
        return header[1 : header.find("]")] if "]" in header else header
    name, _, port = header.rpartition(":")
    return name if name and (port.isdigit() or not port) and ":" not in name else header


@dataclass(frozen=True)
class Hosts:
    """The ``Host`` names the viewer answers for (each without its port, lower case)."""

    names: frozenset[str]
    """Names and addresses allowed as they are."""
    any_address: bool = False
    """Bound to every address: any IP address is allowed too."""

    @classmethod
    def bound(cls, host: str, address: str) -> Hosts:
        """The names of a server given ``host`` (``--host``) that bound ``address``: both, ``localhost`` for a
        loopback address, and for an unspecified one (``0.0.0.0``) this machine's names and any IP address."""
        names = {host.lower().strip("[]"), address.lower()}
        ip = _address(address)
        if ip is not None and ip.is_loopback:
            names |= {"localhost"}
        if ip is not None and ip.is_unspecified:
            names |= LOOPBACK_NAMES | {socket.gethostname().lower(), socket.getfqdn().lower()}
        return cls(frozenset(names - {""}), any_address=ip is not None and ip.is_unspecified)

    def allows(self, header: str) -> bool:
        name = host_name(header)
        return name in self.names or (self.any_address and _address(name) is not None)

    def refusal(self, header: str) -> str:
        """Why a request for ``header`` is not answered: one line."""
        shown = ", ".join(sorted(self.names)) + (" or an IP address" if self.any_address else "")
        return (f"this viewer answers for {shown}, not for host {host_name(header)!r}: a page elsewhere may be "
                "reaching it through a name of its own (DNS rebinding); open it at the address it printed")


LOOPBACK = Hosts(LOOPBACK_NAMES)  # what an app made without a server answers for (the test client's "localhost")


def check_port(port: object) -> int:
    """``port`` when it can be listened on: a whole number from 1 to 65535, or 0 for any free one."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port must be a number from 1 to 65535 (0: any free one), not {port!r}")
    return port


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host``:``port`` (0: a free one, which its name says); a one-line error naming the
    port, and how to choose another, when it cannot be had."""
    check_port(port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as Werkzeug takes it (it serves this socket)
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as err:
        raise ExtractorError(f"cannot listen on {host!r}: {err.strerror}; give --host an address of this machine "
                             "(127.0.0.1: this machine only)") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Werkzeug: a restart need not wait
        sock.bind(address)
        sock.listen(128)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ExtractorError(f"port {port} of {host} is in use by another program: pick another with --port "
                                 "(--port 0: any free one)") from None
        raise ExtractorError(f"cannot listen on {host}:{port}: {err.strerror or err}; pick another --port or "
                             "--host") from None
    return sock
