"""The access policy: principals, rules, rights; peer groups from the kernel."""

from __future__ import annotations

import os
import socket
import tempfile

import pytest

from kvtierd.access import (
    ALL_RIGHTS,
    AccessPolicy,
    Identity,
    NamespaceRule,
    PrincipalError,
    Right,
    parse_principal,
    peer_groups,
)
from kvtierd.config import ConfigError, load_config

ROOT = Identity(uid=0, gids=frozenset({0}))
ALICE = Identity(uid=1000, gids=frozenset({1000, 50}))
BOB = Identity(uid=1001, gids=frozenset({1001}))
CERT = Identity(cert="ops")


def test_principals_parse_and_match() -> None:
    assert parse_principal("uid:1000").matches(ALICE)
    assert not parse_principal("uid:1000").matches(BOB)
    assert parse_principal("gid:50").matches(ALICE)  # a supplementary group
    assert parse_principal("*").matches(BOB) and parse_principal("*").matches(CERT)
    assert parse_principal("cert:ops").matches(CERT)
    assert not parse_principal("cert:ops").matches(ALICE)  # a local peer has no cert name
    assert parse_principal("user:root").matches(ROOT)
    assert parse_principal("group:root").matches(ROOT)
    for bad, why in (("alice", "is not uid:N"), ("uid:x", "uid must be a number"),
                     ("user:no-such-user-kvt", "no such user"),
                     ("group:no-such-group-kvt", "no such group"),
                     ("role:admin", "unknown kind 'role'")):
        with pytest.raises(PrincipalError, match=why):
            parse_principal(bad)


def test_rules_first_match_wins_and_admins_administer_everything() -> None:
    policy = AccessPolicy(
        admin=(parse_principal("uid:0"),),
        default=(parse_principal("gid:50"),),
        namespaces=(
            NamespaceRule("t/ro", read=(parse_principal("uid:1001"),)),
            NamespaceRule("t/*", read=(parse_principal("uid:1001"),),
                          write=(parse_principal("uid:1001"),),
                          admin=(parse_principal("uid:1000"),), dram_quota=1 << 30),
        ),
    )
    assert policy.rights(BOB, "t/ro") == Right.READ  # the first rule, not t/*
    assert policy.rights(BOB, "t/x") == Right.READ | Right.WRITE
    assert policy.rights(ALICE, "t/x") == Right.ADMIN
    assert policy.rights(ALICE, "other") == Right.READ | Right.WRITE  # default: gid 50
    assert policy.rights(BOB, "other") == Right.NONE
    assert policy.rights(ROOT, "t/x") == Right.ADMIN  # daemon admin, not a reader
    assert policy.is_admin(ROOT) and not policy.is_admin(ALICE)
    assert policy.administers_any(ALICE) and not policy.administers_any(BOB)
    assert policy.quotas("t/x") == (1 << 30, 0) and policy.quotas("other") == (0, 0)
    off = AccessPolicy(enabled=False, admin=(), default=())
    assert off.rights(BOB, "anything") == ALL_RIGHTS and off.is_admin(BOB)


def test_access_config_rejects_unknown_rule_keys_and_names() -> None:
    with pytest.raises(ConfigError, match=r"access.namespaces\[0\]: unknown key 'reed'"):
        load_config(None, overrides=['access.namespaces=[{match: "a/*", reed: [uid:1]}]'])
    with pytest.raises(ConfigError, match=r"access.namespaces\[0\].match: expected"):
        load_config(None, overrides=["access.namespaces=[{read: [uid:1]}]"])
    with pytest.raises(ConfigError, match=r"access.admin: 'user:no-such-user-kvt': no such"):
        load_config(None, overrides=["access.admin=[user:no-such-user-kvt]"])
    with pytest.raises(ConfigError, match=r"access.default: expected a list of principals"):
        load_config(None, overrides=["access.default=uid:0"])
    cfg = load_config(None, overrides=[
        'access.namespaces=[{match: "a/*", write: ["uid:7"], ssd_quota: 2GiB}]'])
    assert cfg.access.namespaces[0].ssd_quota == 2 << 30


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set a child's groups")
def test_peer_groups_reports_the_connecting_process_groups() -> None:
    with tempfile.TemporaryDirectory(prefix="kvt-") as d:
        path = os.path.join(d, "s")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        pid = os.fork()
        if pid == 0:  # the child: other groups, then connect
            try:
                os.setgroups([4242, 4343])
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                c.connect(path)
                c.recv(1)
            finally:
                os._exit(0)
        conn, _ = srv.accept()
        try:
            assert sorted(peer_groups(conn) or []) == [4242, 4343]
        finally:
            conn.close()
            srv.close()
            os.waitpid(pid, 0)
