"""Who may do what: principals, namespace rules and the rights they grant.

The session channel learns a client's uid, gid and pid from ``SO_PEERCRED``
(the kernel's word, not the client's) and asks the policy for its rights on
the namespace it declares; the session keeps them, and the service checks
them on every call (a bit test, no lookups).  Admin calls come from an admin
session (``OpenAdmin`` on the session channel) or, over TCP, from a client
certificate.

Principals are written ``uid:N``, ``gid:N``, ``user:NAME``, ``group:NAME``,
``cert:COMMON-NAME`` (TCP clients) or ``*`` (anyone who can reach the socket).
A group matches the peer's primary gid and its supplementary groups (read from
``/proc/<pid>/status`` at connect).  Names resolve when the config loads; an
unknown user or group is a config error, never a silent no-match.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import grp
import os
import pwd
import secrets
import socket
import struct
from collections.abc import Iterable, Sequence
from typing import Final


class Right(enum.IntFlag):
    NONE = 0
    READ = 1    # Lookup, Acquire, Release; read-only segment fds
    WRITE = 2   # Reserve, Commit, Abort, Delete; writable segment fds
    ADMIN = 4   # Stats of the namespace, ListKeys, Evict


ALL_RIGHTS: Final = Right.READ | Right.WRITE | Right.ADMIN


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    """One entry of a rule: a uid, a gid, a certificate name, or anyone."""

    kind: str  # "uid", "gid", "cert" or "any"
    uid_or_gid: int = -1
    name: str = ""

    def matches(self, ident: Identity) -> bool:
        if self.kind == "any":
            return True
        if self.kind == "uid":
            return ident.uid == self.uid_or_gid
        if self.kind == "gid":
            return self.uid_or_gid in ident.gids
        return ident.cert == self.name and bool(self.name)

    def __str__(self) -> str:
        if self.kind == "any":
            return "*"
        if self.kind == "cert":
            return f"cert:{self.name}"
        return f"{self.kind}:{self.uid_or_gid}"


@dataclasses.dataclass(frozen=True, slots=True)
class Identity:
    """Who is calling: a local peer (uid and groups) or a TCP client's certificate name."""

    uid: int = -1
    gids: frozenset[int] = frozenset()
    cert: str = ""

    @classmethod
    def of_peer(cls, pid: int, uid: int, gid: int, proc: str = "/proc",
                groups: Sequence[int] | None = None) -> Identity:
        """A local peer: its primary gid plus its supplementary groups (``groups`` from
        ``SO_PEERGROUPS`` when given, else its process's, read from ``/proc``)."""
        extra = groups if groups is not None else supplementary_groups(pid, proc)
        return cls(uid=uid, gids=frozenset({gid, *extra}))

    def __str__(self) -> str:
        if self.cert:
            return f"certificate {self.cert!r}"
        return f"uid {self.uid}"


#: Linux SO_PEERGROUPS (4.13+): the peer's supplementary groups as they were at
#: connect, valid across pid namespaces (a client container's pid may read as 0).
SO_PEERGROUPS: Final = getattr(socket, "SO_PEERGROUPS", 59)


def peer_groups(conn: socket.socket) -> list[int] | None:
    """The connected peer's supplementary groups, or None where the kernel cannot say
    (an old kernel, or more than the 256 groups Python's getsockopt buffer holds)."""
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, 1024)
    except OSError:
        return None
    return list(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))


def supplementary_groups(pid: int, proc: str = "/proc") -> list[int]:
    """The ``Groups:`` line of ``/proc/<pid>/status`` (empty if the process is gone)."""
    try:
        with open(f"{proc}/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return [int(g) for g in line.split()[1:]]
    except (OSError, ValueError):
        pass
    return []


class PrincipalError(ValueError):
    """A principal that does not parse or names an unknown user or group."""


def parse_principal(text: str) -> Principal:
    text = text.strip()
    if text == "*":
        return Principal("any")
    kind, sep, value = text.partition(":")
    if not sep or not value:
        raise PrincipalError(f"{text!r} is not uid:N, gid:N, user:NAME, group:NAME, "
                             "cert:NAME or *")
    if kind in ("uid", "gid"):
        if not value.isdigit():
            raise PrincipalError(f"{text!r}: {kind} must be a number")
        return Principal(kind, int(value))
    if kind == "user":
        try:
            return Principal("uid", pwd.getpwnam(value).pw_uid)
        except KeyError:
            raise PrincipalError(f"{text!r}: no such user on this host") from None
    if kind == "group":
        try:
            return Principal("gid", grp.getgrnam(value).gr_gid)
        except KeyError:
            raise PrincipalError(f"{text!r}: no such group on this host") from None
    if kind == "cert":
        return Principal("cert", name=value)
    raise PrincipalError(f"{text!r}: unknown kind {kind!r} (uid, gid, user, group, cert or *)")


def default_principals() -> tuple[Principal, ...]:
    """Root, the daemon's own user, and the ``kvtier`` group when the host has one.

    Root is listed because it reads any segment file regardless; refusing it
    at the socket would protect nothing.
    """
    out = [Principal("uid", 0)]
    if os.getuid() != 0:
        out.append(Principal("uid", os.getuid()))
    try:
        out.append(Principal("gid", grp.getgrnam("kvtier").gr_gid))
    except KeyError:
        pass
    return tuple(out)


@dataclasses.dataclass(frozen=True, slots=True)
class NamespaceRule:
    """Rights on the namespaces whose names match ``match`` (a shell glob)."""

    match: str
    read: tuple[Principal, ...] = ()
    write: tuple[Principal, ...] = ()
    admin: tuple[Principal, ...] = ()
    dram_quota: int = 0  # bytes of DRAM the namespace may hold; 0 = no quota
    ssd_quota: int = 0   # bytes of the SSD tier the namespace may hold; 0 = no quota

    def rights(self, ident: Identity) -> Right:
        r = Right.NONE
        if _any(self.read, ident):
            r |= Right.READ
        if _any(self.write, ident):
            r |= Right.WRITE
        if _any(self.admin, ident):
            r |= Right.ADMIN
        return r


def _any(principals: Iterable[Principal], ident: Identity) -> bool:
    return any(p.matches(ident) for p in principals)


@dataclasses.dataclass(frozen=True, slots=True)
class AccessPolicy:
    """The daemon's rules; ``enabled=False`` grants everyone everything."""

    enabled: bool = True
    admin: tuple[Principal, ...] = dataclasses.field(default_factory=default_principals)
    default: tuple[Principal, ...] = dataclasses.field(default_factory=default_principals)
    namespaces: tuple[NamespaceRule, ...] = ()

    def rule_for(self, namespace: str) -> NamespaceRule | None:
        """The first rule whose pattern matches ``namespace`` (None: the default applies)."""
        return next((r for r in self.namespaces if fnmatch.fnmatchcase(namespace, r.match)),
                    None)

    def rights(self, ident: Identity, namespace: str) -> Right:
        """What ``ident`` may do in ``namespace`` (daemon admins administer every namespace)."""
        if not self.enabled:
            return ALL_RIGHTS
        rule = self.rule_for(namespace)
        if rule is None:
            r = Right.READ | Right.WRITE if _any(self.default, ident) else Right.NONE
        else:
            r = rule.rights(ident)
        if self.is_admin(ident):
            r |= Right.ADMIN
        return r

    def is_admin(self, ident: Identity) -> bool:
        """Daemon-wide admin: every namespace's stats, check, drain, evict, ls --keys."""
        return not self.enabled or _any(self.admin, ident)

    def administers_any(self, ident: Identity) -> bool:
        """Daemon admin, or admin of some namespace rule: may open an admin session."""
        return self.is_admin(ident) or any(_any(r.admin, ident) for r in self.namespaces)

    def quotas(self, namespace: str) -> tuple[int, int]:
        """(DRAM, SSD) byte quotas of ``namespace``; 0 = none."""
        rule = self.rule_for(namespace)
        return (rule.dram_quota, rule.ssd_quota) if rule is not None else (0, 0)


@dataclasses.dataclass(frozen=True, slots=True)
class AdminSession:
    """An admin session: who opened it (no namespace, no fds)."""

    token: str
    ident: Identity


class AdminSessions:
    """Tokens of the open admin sessions; each lives as long as its connection."""

    def __init__(self) -> None:
        self._by_token: dict[str, AdminSession] = {}

    def open(self, ident: Identity) -> AdminSession:
        session = AdminSession(secrets.token_hex(16), ident)
        self._by_token[session.token] = session
        return session

    def close(self, session: AdminSession) -> None:
        self._by_token.pop(session.token, None)

    def get(self, token: str) -> AdminSession | None:
        return self._by_token.get(token)

    def count_uid(self, uid: int) -> int:
        return sum(1 for s in self._by_token.values() if s.ident.uid == uid)
