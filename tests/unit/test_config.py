"""Tests for kvtierd.config and kvtier._paths."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvtier._paths import (
    GRPC_SOCKET_NAME,
    SESSION_SOCKET_NAME,
    default_shm_dir,
    default_socket_dir,
)
from kvtierd import config as C
from kvtierd.config import (
    Config,
    ConfigError,
    DramConfig,
    LeaseConfig,
    LogConfig,
    MetricsConfig,
    ReservationConfig,
    ServerConfig,
    SpillConfig,
    config_to_dict,
    default_spill_dir,
    format_duration,
    format_size,
    load_config,
    parse_duration,
    parse_size,
)

SHIPPED = Path(__file__).resolve().parents[2] / "config" / "kvtier.yaml"
UID = os.getuid()
#: A fixed, minimal environment so the host's own variables never leak in.
BASE_ENV: Mapping[str, str] = {"HOME": "/home/tester", "XDG_RUNTIME_DIR": "/run/user/1000"}


def env(**extra: str) -> dict[str, str]:
    return {**BASE_ENV, **extra}


def write(tmp_path: Path, text: str, name: str = "kvtier.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(text: str | None = None, tmp_path: Path | None = None, **kwargs: object) -> Config:
    """Load with BASE_ENV (unless env= is given) and optionally a file with ``text``."""
    path = None
    if text is not None:
        assert tmp_path is not None
        path = write(tmp_path, text)
    kwargs.setdefault("env", dict(BASE_ENV))
    return load_config(path, **kwargs)  # type: ignore[arg-type]


def expected_defaults(e: Mapping[str, str] = BASE_ENV, instance: str = "default") -> Config:
    return Config(
        instance=instance,
        server=ServerConfig(
            socket_dir=default_socket_dir(e),
            socket_mode=0o660,
            max_message_bytes=4 * 1024**2,
            max_keys_per_call=4096,
            grace=2.0,
        ),
        dram=DramConfig(
            shm_dir=default_shm_dir(instance),
            capacity=1024**3,
            extent_size=64 * 1024**2,
            prefault_threads=0,
            mlock=True,
        ),
        leases=LeaseConfig(ttl=300.0),
        reservations=ReservationConfig(ttl=60.0),
        spill=SpillConfig(ssd_dir=default_spill_dir(e, instance)),
        metrics=MetricsConfig(address="127.0.0.1:9464", host="127.0.0.1", port=9464),
        log=LogConfig(level="info"),
    )


def error_of(*args: object, **kwargs: object) -> str:
    """The message of the ConfigError that ``load(*args, **kwargs)`` raises."""
    with pytest.raises(ConfigError) as info:
        load(*args, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


# ---------------------------------------------------------------------------
# kvtier._paths
# ---------------------------------------------------------------------------


def test_socket_dir_prefers_kvtier_socket_dir() -> None:
    assert default_socket_dir({"KVTIER_SOCKET_DIR": "/x", "XDG_RUNTIME_DIR": "/run/u"}) == "/x"


def test_socket_dir_empty_kvtier_socket_dir_falls_to_xdg() -> None:
    assert (
        default_socket_dir({"KVTIER_SOCKET_DIR": "", "XDG_RUNTIME_DIR": "/run/u"})
        == "/run/u/kvtier"
    )


def test_socket_dir_without_xdg_is_per_uid_under_tmp() -> None:
    assert default_socket_dir({}) == f"/tmp/kvtier-{UID}"
    assert default_socket_dir({"XDG_RUNTIME_DIR": ""}) == f"/tmp/kvtier-{UID}"


def test_socket_dir_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_SOCKET_DIR", "/from/environ")
    assert default_socket_dir() == "/from/environ"


def test_spill_dir_defaults_to_the_state_directory() -> None:
    assert default_spill_dir({"HOME": "/h"}, "a") == "/h/.local/state/kvtier/a/spill"
    assert default_spill_dir({"HOME": "/h", "XDG_STATE_HOME": "/s"}, "a") == \
        "/s/kvtier/a/spill"
    # systemd's StateDirectory= (several are ':'-separated; the first is ours)
    assert default_spill_dir({"HOME": "/h", "STATE_DIRECTORY": "/var/lib/kvtier:/x"}, "b") \
        == "/var/lib/kvtier/b/spill"
    assert load(env={**BASE_ENV, "KVTIER_SPILL_SSD_DIR": ""}).spill.ssd_dir == ""
    assert load(overrides=["spill.ssd_dir="]).spill.ssd_dir == ""


def test_socket_names_and_shm_dir() -> None:
    assert GRPC_SOCKET_NAME == "kvtier.sock"
    assert SESSION_SOCKET_NAME == "kvtier-session.sock"
    assert default_shm_dir("a-1") == f"/dev/shm/kvtier-{UID}-a-1"


# ---------------------------------------------------------------------------
# Defaults and the shipped file
# ---------------------------------------------------------------------------


def test_no_sources_gives_the_builtin_defaults() -> None:
    assert load() == expected_defaults()


def test_defaults_read_os_environ_when_env_not_given(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("KVTIER_SOCKET_DIR", "/srv/sock")
    monkeypatch.setenv("KVTIER_DRAM_CAPACITY", "2GiB")
    cfg = load_config()
    assert cfg.server.socket_dir == "/srv/sock"
    assert cfg.dram.capacity == 2 * 1024**3


def test_socket_paths_are_under_socket_dir() -> None:
    cfg = load()
    assert cfg.server.grpc_socket == "/run/user/1000/kvtier/kvtier.sock"
    assert cfg.server.session_socket == "/run/user/1000/kvtier/kvtier-session.sock"


def test_defaults_match_the_named_constants() -> None:
    cfg = load()
    assert cfg.instance == C.DEFAULT_INSTANCE
    assert cfg.server.socket_mode == C.DEFAULT_SOCKET_MODE
    assert cfg.server.max_message_bytes == C.DEFAULT_MAX_MESSAGE_BYTES
    assert cfg.server.max_keys_per_call == C.DEFAULT_MAX_KEYS_PER_CALL
    assert cfg.server.grace == C.DEFAULT_GRACE
    assert cfg.dram.capacity == C.DEFAULT_DRAM_CAPACITY
    assert cfg.dram.extent_size == C.DEFAULT_EXTENT_SIZE
    assert cfg.dram.prefault_threads == C.DEFAULT_PREFAULT_THREADS
    assert cfg.dram.mlock is C.DEFAULT_MLOCK
    assert cfg.leases.ttl == C.DEFAULT_LEASE_TTL
    assert cfg.reservations.ttl == C.DEFAULT_RESERVATION_TTL
    assert cfg.metrics.address == C.DEFAULT_METRICS_ADDRESS
    assert cfg.log.level == C.DEFAULT_LOG_LEVEL


def test_every_default_constant_has_a_comment_saying_why() -> None:
    source = Path(C.__file__).read_text().splitlines()
    names = [n for n in vars(C) if re.fullmatch(r"(DEFAULT|MIN|MAX)_[A-Z_]+", n)]
    assert names
    for name in names:
        (line_no,) = [i for i, line in enumerate(source) if line.startswith(f"{name}: Final")]
        assert source[line_no - 1].startswith("#: "), name


def test_shipped_file_equals_the_builtin_defaults() -> None:
    assert load_config(SHIPPED, env=dict(BASE_ENV)) == expected_defaults()


def _documented_keys(text: str) -> dict[str, list[int]]:
    """Map 'section.key' (or a top-level key) to the line numbers that set or show it."""
    found: dict[str, list[int]] = {}
    section = None
    for no, line in enumerate(text.splitlines()):
        top = re.fullmatch(r"([a-z_]+):.*", line)
        if top:
            section = top.group(1)
            found.setdefault(section, []).append(no)
            continue
        sub = re.fullmatch(r"  (?:# )?([a-z_]+):.*", line)
        if sub and section is not None:
            found.setdefault(f"{section}.{sub.group(1)}", []).append(no)
    return found


def test_shipped_file_documents_every_field() -> None:
    text = SHIPPED.read_text()
    documented = _documented_keys(text)
    fields = {"instance"} | {
        f"{section}.{f.name}"
        for section, cls in C.SECTIONS.items()
        for f in dataclasses.fields(cls)
        if not f.metadata.get("derived")
    }
    assert {f.name for f in dataclasses.fields(Config)} == {"instance", *C.SECTIONS}
    assert fields <= documented.keys()
    assert documented.keys() - set(C.SECTIONS) == fields  # documents nothing that is not a key
    lines = text.splitlines()
    for key in fields:
        first = documented[key][0]
        # A comment explains each key; for socket_dir/shm_dir the key line itself is a comment.
        above = lines[first - 1].strip()
        assert above.startswith("#"), key


def test_shipped_file_leaves_computed_paths_commented_out() -> None:
    data = yaml.safe_load(SHIPPED.read_text())
    assert "socket_dir" not in data["server"]
    assert "shm_dir" not in data["dram"]


def test_metrics_host_and_port_are_derived_not_keys() -> None:
    assert C.SECTION_KEYS["metrics"] == ("address",)


# ---------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------


def test_file_values_are_loaded(tmp_path: Path) -> None:
    cfg = load(
        """
instance: node-7
server:
  socket_dir: /run/kvtier
  socket_mode: "0600"
  max_message_bytes: 16MiB
  max_keys_per_call: 100
  grace: 500ms
dram:
  shm_dir: /dev/shm/custom
  capacity: 64GiB
  extent_size: 1GiB
  prefault_threads: 8
  mlock: false
leases:
  ttl: 5m
reservations:
  ttl: 10
spill:
  ssd_dir: /mnt/nvme/kvt
  ssd_capacity: 1TiB
  ssd_file_size: 2GiB
  ssd_direct_io: true
  shared_dir: /lustre/kvt
  shared_write: commit
  clean_ahead: 0.25
  queue_depth: 8
  io_threads: 2
  backpressure_timeout: 3s
metrics:
  address: "[::1]:0"
log:
  level: debug
""",
        tmp_path,
    )
    assert cfg == Config(
        instance="node-7",
        server=ServerConfig("/run/kvtier", 0o600, 16 * 1024**2, 100, 0.5),
        dram=DramConfig("/dev/shm/custom", 64 * 1024**3, 1024**3, 8, False),
        leases=LeaseConfig(300.0),
        reservations=ReservationConfig(10.0),
        spill=SpillConfig("/mnt/nvme/kvt", 1024**4, 2 * 1024**3, "true", "/lustre/kvt",
                          "commit", 0.25, 8, 2, 3.0),
        metrics=MetricsConfig("[::1]:0", "::1", 0),
        log=LogConfig("debug"),
    )


def test_file_sets_only_what_it_names(tmp_path: Path) -> None:
    cfg = load("dram:\n  capacity: 2GiB\n", tmp_path)
    assert cfg == dataclasses.replace(
        expected_defaults(),
        dram=dataclasses.replace(expected_defaults().dram, capacity=2 * 1024**3),
    )


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n", "dram:\nleases:\n"])
def test_empty_file_or_empty_sections_give_defaults(tmp_path: Path, text: str) -> None:
    assert load(text, tmp_path) == expected_defaults()


def test_file_that_is_a_list_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "- instance: a\n- dram: {}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env=dict(BASE_ENV))
    message = str(info.value)
    assert message.startswith(f"{path}: expected a mapping of sections at the top level, got list")


def test_file_that_is_a_scalar_is_an_error(tmp_path: Path) -> None:
    assert "expected a mapping of sections at the top level, got str 'hello'" in error_of(
        "hello\n", tmp_path
    )


def test_missing_file_is_an_error_naming_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"^.*nope\.yaml: config file not found$"):
        load_config(missing, env=dict(BASE_ENV))


def test_unreadable_path_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file"):
        load_config(tmp_path, env=dict(BASE_ENV))  # a directory


def test_invalid_yaml_is_an_error_naming_the_file(tmp_path: Path) -> None:
    message = error_of("dram: [unclosed\n", tmp_path)
    assert message.startswith(f"{tmp_path / 'kvtier.yaml'}: invalid YAML:")
    assert "line" in message


def test_kvtier_config_env_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "dram:\n  capacity: 3GiB\n")
    cfg = load_config(env=env(KVTIER_CONFIG=str(path)))
    assert cfg.dram.capacity == 3 * 1024**3


def test_explicit_path_beats_kvtier_config(tmp_path: Path) -> None:
    a = write(tmp_path, "dram:\n  capacity: 3GiB\n", "a.yaml")
    b = write(tmp_path, "dram:\n  capacity: 5GiB\n", "b.yaml")
    assert load_config(b, env=env(KVTIER_CONFIG=str(a))).dram.capacity == 5 * 1024**3


def test_empty_kvtier_config_means_no_file() -> None:
    assert load_config(env=env(KVTIER_CONFIG="")) == expected_defaults()


def test_missing_kvtier_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(env=env(KVTIER_CONFIG=str(tmp_path / "gone.yaml")))


def test_unknown_section_key_message(tmp_path: Path) -> None:
    message = error_of("dram:\n  capasity: 2GiB\n", tmp_path)
    assert message == (
        f"{tmp_path / 'kvtier.yaml'}: unknown key 'dram.capasity' "
        "(known: capacity, extent_size, grow_ahead, mlock, prefault_threads, shm_dir)"
    )


def test_unknown_top_level_key_message(tmp_path: Path) -> None:
    message = error_of("drams:\n  capacity: 2GiB\n", tmp_path)
    assert message.endswith(
        "unknown key 'drams' (known: access, cluster, dram, events, instance, leases, limits, log, metrics, "
            "reservations, server, spill)"
    )


def test_dotted_key_at_top_level_is_unknown(tmp_path: Path) -> None:
    assert "unknown key 'dram.capacity'" in error_of("dram.capacity: 2GiB\n", tmp_path)


def test_section_that_is_not_a_mapping_is_an_error(tmp_path: Path) -> None:
    message = error_of("dram: 5\n", tmp_path)
    assert message.startswith("dram: expected a mapping of shm_dir, capacity")
    assert message.endswith(f"got 5 (from {tmp_path / 'kvtier.yaml'})")


def test_value_error_names_key_and_source_file(tmp_path: Path) -> None:
    message = error_of("dram:\n  capacity: lots\n", tmp_path)
    assert message == (
        f"dram.capacity: expected a size like '64GiB', got 'lots' (from {tmp_path / 'kvtier.yaml'})"
    )


# ---------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------


def test_env_sets_values() -> None:
    cfg = load_config(
        env=env(
            KVTIER_INSTANCE="gpu0",
            KVTIER_DRAM_CAPACITY="2GiB",
            KVTIER_DRAM_MLOCK="false",
            KVTIER_DRAM_PREFAULT_THREADS="4",
            KVTIER_SERVER_SOCKET_DIR="/run/kvtier",
            KVTIER_SERVER_GRACE="1.5",
            KVTIER_LEASES_TTL="1h",
            KVTIER_LOG_LEVEL="WARNING",
        )
    )
    assert cfg.instance == "gpu0"
    assert cfg.dram.capacity == 2 * 1024**3
    assert cfg.dram.mlock is False
    assert cfg.dram.prefault_threads == 4
    assert cfg.server.socket_dir == "/run/kvtier"
    assert cfg.server.grace == 1.5
    assert cfg.leases.ttl == 3600.0
    assert cfg.log.level == "warning"


def test_empty_metrics_address_env_disables_metrics() -> None:
    metrics = load_config(env=env(KVTIER_METRICS_ADDRESS="")).metrics
    assert metrics == MetricsConfig(address="", host=None, port=0)
    assert not metrics.enabled


def test_env_text_keys_keep_what_yaml_would_read_as_numbers() -> None:
    cfg = load_config(env=env(KVTIER_SERVER_SOCKET_MODE="0600", KVTIER_INSTANCE="123"))
    assert cfg.server.socket_mode == 0o600
    assert cfg.instance == "123"


def test_env_quoted_text_is_unquoted() -> None:
    assert load_config(env=env(KVTIER_INSTANCE="'abc'")).instance == "abc"


def test_unknown_key_in_a_known_section_env_is_an_error_naming_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env(KVTIER_DRAM_CAPASITY="2GiB"))
    assert str(info.value) == (
        "KVTIER_DRAM_CAPASITY: unknown key 'dram.capasity' "
        "(known: capacity, extent_size, grow_ahead, mlock, prefault_threads, shm_dir)"
    )


@pytest.mark.parametrize(
    "name",
    ["KVTIER_FORCE_PY", "KVTIER_SOCKET_DIR", "KVTIER_CONFIG", "KVTIER_LOGFILE", "KVTIERX_DRAM_Y"],
)
def test_kvtier_env_vars_outside_any_section_are_ignored(name: str) -> None:
    value = "/elsewhere" if name == "KVTIER_SOCKET_DIR" else ""
    cfg = load_config(env=env(**{name: value}))
    expected = expected_defaults(env(**{name: value}))
    assert cfg == expected


def test_env_value_error_names_key_and_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env(KVTIER_DRAM_CAPACITY="lots"))
    assert str(info.value) == (
        "dram.capacity: expected a size like '64GiB', got 'lots' (from KVTIER_DRAM_CAPACITY)"
    )


def test_env_empty_value_for_a_number_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"^server\.max_keys_per_call: .* got ''"):
        load_config(env=env(KVTIER_SERVER_MAX_KEYS_PER_CALL=""))


# ---------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------


def test_overrides_set_values() -> None:
    cfg = load(
        overrides=[
            "dram.capacity=2GiB",
            "instance=b",
            "metrics.address=",
            "server.socket_mode=0640",
            "dram.mlock=false",
            "reservations.ttl=250ms",
        ]
    )
    assert cfg.dram.capacity == 2 * 1024**3
    assert cfg.instance == "b"
    assert cfg.metrics.host is None
    assert cfg.server.socket_mode == 0o640
    assert cfg.dram.mlock is False
    assert cfg.reservations.ttl == 0.25


def test_later_override_wins() -> None:
    assert load(overrides=["dram.capacity=2GiB", "dram.capacity=3GiB"]).dram.capacity == 3 * 1024**3


def test_override_value_may_contain_equals() -> None:
    with pytest.raises(ConfigError, match=r"^log\.level: .*got 'a=b'"):
        load(overrides=["log.level=a=b"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "dram.capasity=1",
            (
                "override 'dram.capasity=1': unknown key 'dram.capasity' "
                "(known: capacity, extent_size, grow_ahead, mlock, prefault_threads, shm_dir)"
            ),
        ),
        (
            "drm.capacity=1",
            (
                "override 'drm.capacity=1': unknown key 'drm.capacity' "
                "(known: access, cluster, dram, events, instance, leases, limits, log, metrics, reservations, server, "
                "spill)"
            ),
        ),
        (
            "dram=1",
            (
                "override 'dram=1': unknown key 'dram' "
                "(known: access, cluster, dram, events, instance, leases, limits, log, metrics, reservations, server, "
                "spill)"
            ),
        ),
        ("dram.capacity", "override 'dram.capacity': expected 'section.key=value'"),
    ],
)
def test_bad_override_messages(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(overrides=[override])
    assert str(info.value) == message


def test_override_value_error_names_key_and_override() -> None:
    with pytest.raises(ConfigError) as info:
        load(overrides=["leases.ttl=soon"])
    assert str(info.value) == (
        "leases.ttl: expected a duration like '30s', got 'soon' (from override 'leases.ttl=soon')"
    )


def test_overrides_as_a_bare_string_is_a_type_error() -> None:
    with pytest.raises(TypeError):
        load(overrides="dram.capacity=2GiB")


# ---------------------------------------------------------------------------
# Precedence
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_file", "in_env", "in_override", "expected"),
    [
        (False, False, False, "1GiB"),
        (True, False, False, "2GiB"),
        (True, True, False, "3GiB"),
        (False, True, False, "3GiB"),
        (True, True, True, "4GiB"),
        (True, False, True, "4GiB"),
        (False, False, True, "4GiB"),
    ],
)
def test_precedence_defaults_file_env_overrides(
    tmp_path: Path, in_file: bool, in_env: bool, in_override: bool, expected: str
) -> None:
    path = write(tmp_path, "dram:\n  capacity: 2GiB\n") if in_file else None
    e = env(KVTIER_DRAM_CAPACITY="3GiB") if in_env else env()
    overrides = ["dram.capacity=4GiB"] if in_override else []
    cfg = load_config(path, env=e, overrides=overrides)
    assert cfg.dram.capacity == parse_size(expected, "x")


def test_each_layer_overrides_only_its_own_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "dram:\n  capacity: 2GiB\n  prefault_threads: 2\nlog:\n  level: debug\n")
    cfg = load_config(
        path,
        env=env(KVTIER_DRAM_PREFAULT_THREADS="3", KVTIER_LEASES_TTL="10s"),
        overrides=["leases.ttl=20s"],
    )
    assert (cfg.dram.capacity, cfg.dram.prefault_threads) == (2 * 1024**3, 3)
    assert (cfg.log.level, cfg.leases.ttl) == ("debug", 20.0)


def test_a_bad_value_in_a_lower_layer_is_still_fatal_only_if_used(tmp_path: Path) -> None:
    # The winning value is the one validated; a shadowed one is never read.
    path = write(tmp_path, "dram:\n  capacity: lots\n")
    cfg = load_config(path, env=env(), overrides=["dram.capacity=2GiB"])
    assert cfg.dram.capacity == 2 * 1024**3


# ---------------------------------------------------------------------------
# Instance and paths
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("source", ["file", "env", "override"])
def test_shm_dir_follows_instance_from_any_source(tmp_path: Path, source: str) -> None:
    path = write(tmp_path, "instance: blue\n") if source == "file" else None
    e = env(KVTIER_INSTANCE="blue") if source == "env" else env()
    overrides = ["instance=blue"] if source == "override" else []
    cfg = load_config(path, env=e, overrides=overrides)
    assert cfg.instance == "blue"
    assert cfg.dram.shm_dir == f"/dev/shm/kvtier-{UID}-blue"


def test_instance_from_override_wins_over_file_for_shm_dir(tmp_path: Path) -> None:
    path = write(tmp_path, "instance: blue\n")
    cfg = load_config(path, env=env(), overrides=["instance=green"])
    assert cfg.dram.shm_dir == default_shm_dir("green")


def test_explicit_shm_dir_is_not_changed_by_instance() -> None:
    cfg = load(overrides=["instance=blue", "dram.shm_dir=/dev/shm/mine"])
    assert cfg.dram.shm_dir == "/dev/shm/mine"


@pytest.mark.parametrize("bad", ["", "a b", "x" * 65, "a/b", "é", 5, True, None])
def test_bad_instance_names_are_rejected(tmp_path: Path, bad: object) -> None:
    message = error_of(yaml.safe_dump({"instance": bad}), tmp_path)
    assert message.startswith("instance: expected a name of 1-64 characters from [A-Za-z0-9_-]")


def test_longest_instance_name_is_accepted() -> None:
    assert load(overrides=["instance=" + "x" * 64]).instance == "x" * 64


def test_paths_expand_home_and_env_vars() -> None:
    cfg = load_config(env=env(KVTIER_SERVER_SOCKET_DIR="~/sock"))
    assert cfg.server.socket_dir == "/home/tester/sock"
    assert load_config(env=env(KVTIER_SERVER_SOCKET_DIR="~")).server.socket_dir == "/home/tester"
    cfg = load_config(
        env=env(KVTIER_DRAM_SHM_DIR="${SHM}/kv/$USER/", SHM="/dev/shm", USER="ann"),
    )
    assert cfg.dram.shm_dir == "/dev/shm/kv/ann"


def test_unset_variable_in_a_path_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env(KVTIER_DRAM_SHM_DIR="$NOPE/kv"))
    assert str(info.value) == (
        "dram.shm_dir: environment variable 'NOPE' is not set (in '$NOPE/kv') "
        "(from KVTIER_DRAM_SHM_DIR)"
    )


@pytest.mark.parametrize("bad", ["relative/dir", "", 5, "~nosuchuser_kvtier/x"])
def test_non_absolute_paths_are_rejected(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"^server\.socket_dir: expected an absolute path"):
        load(overrides=[f"server.socket_dir={bad}"])


def test_relative_default_socket_dir_is_reported_with_its_source() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env={"KVTIER_SOCKET_DIR": "rel"})
    assert str(info.value) == (
        "server.socket_dir: expected an absolute path, got 'rel' (from KVTIER_SOCKET_DIR)"
    )


def test_paths_are_normalised() -> None:
    assert load(overrides=["server.socket_dir=/run//kvtier/./x/"]).server.socket_dir == (
        "/run/kvtier/x"
    )


# ---------------------------------------------------------------------------
# Sizes and durations
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("0", 0),
        ("17B", 17),
        ("512KiB", 512 * 1024),
        ("64MiB", 64 * 1024**2),
        ("1GiB", 1024**3),
        ("2TiB", 2 * 1024**4),
        ("1KB", 1000),
        ("3MB", 3_000_000),
        ("1GB", 10**9),
        ("1TB", 10**12),
        ("1.5GiB", 3 * 512 * 1024**2),
        ("0.5KiB", 512),
        (" 64 MiB ", 64 * 1024**2),
        (10**15, 10**15),
    ],
)
def test_parse_size_accepts(value: object, expected: int) -> None:
    assert parse_size(value, "k") == expected


@pytest.mark.parametrize(
    "value",
    ["lots", "", "-1", -1, 1.5, "64gib", "64g", "64 Gb", "1e3", "MiB", True, False, None, [1]],
)
def test_parse_size_rejects_with_key_and_value(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(value, "dram.capacity")
    assert str(info.value).startswith(f"dram.capacity: expected a size like '64GiB', got {value!r}")


def test_parse_size_rejects_fractional_bytes() -> None:
    with pytest.raises(ConfigError, match=r"^k: expected a whole number of bytes, got '1\.5'"):
        parse_size("1.5", "k")


def test_parse_size_fractional_bytes_message() -> None:
    with pytest.raises(ConfigError) as info:
        parse_size("0.3KiB", "k")
    assert str(info.value) == "k: expected a whole number of bytes, got '0.3KiB'"


def test_parse_size_bad_unit_lists_units() -> None:
    with pytest.raises(ConfigError) as info:
        parse_size("64g", "dram.capacity")
    assert "units: B, KiB, MiB, GiB, TiB; KB, MB, GB, TB are decimal" in str(info.value)


def test_parse_size_reads_short_units_as_binary() -> None:
    """One meaning of 64K everywhere (kvtier.units): 64 KiB, as in kvtier bench."""
    assert parse_size("64K", "k") == 64 * 1024
    assert parse_size("2G", "k") == 2 * 1024**3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0, 0.0),
        (30, 30.0),
        (1.5, 1.5),
        ("30", 30.0),
        ("30s", 30.0),
        ("250ms", 0.25),
        ("1ms", 0.001),
        ("200us", 0.0002),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1.5h", 5400.0),
        ("0s", 0.0),
        (" 2 s ", 2.0),
    ],
)
def test_parse_duration_accepts(value: object, expected: float) -> None:
    assert parse_duration(value, "k") == expected


@pytest.mark.parametrize(
    "value",
    [
        "soon",
        "",
        "-1s",
        -1,
        -0.5,
        "1d",
        "1 min",
        "5S",
        "1m30s",
        float("inf"),
        float("nan"),
        True,
        None,
    ],
)
def test_parse_duration_rejects_with_key_and_value(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_duration(value, "leases.ttl")
    assert str(info.value).startswith(f"leases.ttl: expected a duration like '30s', got {value!r}")


@given(st.integers(min_value=0, max_value=2**50))
def test_format_size_round_trips(n: int) -> None:
    assert parse_size(format_size(n), "k") == n


@given(st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False))
def test_format_duration_round_trips(seconds: float) -> None:
    assert parse_duration(format_duration(seconds), "k") == seconds


def test_format_duration_names_microseconds_below_a_millisecond() -> None:
    assert format_duration(0.0002) == "200us"
    assert format_duration(0.0015) == "1500us"
    assert format_duration(0.25) == "250ms"


def test_busy_poll_takes_up_to_ten_milliseconds() -> None:
    assert load_config(None, env=dict(BASE_ENV), overrides=["server.busy_poll=200us"]
                       ).server.busy_poll == 0.0002
    assert load_config(None, env=dict(BASE_ENV)).server.busy_poll == 0.0
    with pytest.raises(ConfigError, match=r"server.busy_poll: expected a duration of at most "
                                          r"10ms like '200us' \(0 = off\), got '11ms'"):
        load_config(None, env=dict(BASE_ENV), overrides=["server.busy_poll=11ms"])


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0B"), (1023, "1023B"), (1024, "1KiB"), (3 * 1024**3, "3GiB"), (10**9, "1000000000B")],
)
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


@pytest.mark.parametrize(
    ("s", "text"), [(300.0, "300s"), (0.25, "250ms"), (0.0, "0s"), (1.0005, "1.0005s")]
)
def test_format_duration(s: float, text: str) -> None:
    assert format_duration(s) == text


# ---------------------------------------------------------------------------
# Types and ranges
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        ("dram:\n  mlock: yes\n", "dram.mlock: expected true or false, got 'yes'"),
        ("dram:\n  mlock: on\n", "dram.mlock: expected true or false, got 'on'"),
        ("dram:\n  mlock: 1\n", "dram.mlock: expected true or false, got 1"),
        ("dram:\n  mlock: 'true'\n", "dram.mlock: expected true or false, got 'true'"),
        (
            "dram:\n  prefault_threads: true\n",
            "dram.prefault_threads: expected an integer >= 0, got True",
        ),
        (
            "dram:\n  prefault_threads: -1\n",
            "dram.prefault_threads: expected an integer >= 0, got -1",
        ),
        (
            "dram:\n  prefault_threads: '4'\n",
            "dram.prefault_threads: expected an integer >= 0, got '4'",
        ),
        (
            "dram:\n  prefault_threads: 2.0\n",
            "dram.prefault_threads: expected an integer >= 0, got 2.0",
        ),
        (
            "server:\n  max_keys_per_call: 0\n",
            "server.max_keys_per_call: expected an integer in 1..1000000, got 0",
        ),
        (
            "server:\n  max_keys_per_call: 1000001\n",
            "server.max_keys_per_call: expected an integer in 1..1000000, got 1000001",
        ),
        (
            "server:\n  max_keys_per_call: false\n",
            "server.max_keys_per_call: expected an integer in 1..1000000, got False",
        ),
        (
            "server:\n  max_message_bytes: 32KiB\n",
            "server.max_message_bytes: expected a size of at least 64KiB, got '32KiB'",
        ),
        (
            "server:\n  max_message_bytes: 2GiB\n",
            "server.max_message_bytes: expected a size of at most 2147483647 bytes, got '2GiB'",
        ),
        (
            "server:\n  max_message_bytes: true\n",
            "server.max_message_bytes: expected a size like '64GiB', got True",
        ),
        ("server:\n  grace: -1\n", "server.grace: expected a duration like '30s', got -1"),
        (
            "dram:\n  capacity: 512KiB\n",
            "dram.capacity: expected a size of at least 1MiB, got '512KiB'",
        ),
        (
            "dram:\n  extent_size: 32KiB\n",
            "dram.extent_size: expected a size of at least 64KiB, got '32KiB'",
        ),
        (
            "dram:\n  extent_size: 100000\n",
            "dram.extent_size: expected a multiple of the page size (4096 bytes), got 100000",
        ),
        (
            "dram:\n  capacity: 16MiB\n  extent_size: 32MiB\n",
            "dram.extent_size: expected a size of at most dram.capacity (16MiB), got '32MiB'",
        ),
        ("leases:\n  ttl: 0\n", "leases.ttl: expected a duration from 100ms to 3600s, got 0"),
        (
            "reservations:\n  ttl: 0s\n",
            "reservations.ttl: expected a duration from 100ms to 3600s, got '0s'",
        ),
        ("leases:\n  ttl: 2h\n", "leases.ttl: expected a duration from 100ms to 3600s, got '2h'"),
        (
            "log:\n  level: verbose\n",
            "log.level: expected one of debug, info, warning, error, got 'verbose'",
        ),
        ("log:\n  level: 1\n", "log.level: expected one of debug, info, warning, error, got 1"),
        (
            "server:\n  socket_mode: 0660\n",
            (
                "server.socket_mode: expected an octal mode string like '0660', got 432 "
                "(quote it: YAML reads an unquoted 0660 as the integer 432)"
            ),
        ),
        (
            "server:\n  socket_mode: '0888'\n",
            "server.socket_mode: expected an octal mode string like '0660', got '0888'",
        ),
        (
            "server:\n  socket_mode: '4660'\n",
            "server.socket_mode: expected permission bits only (at most '0777'), got '4660'",
        ),
        (
            "server:\n  socket_mode: '0060'\n",
            (
                "server.socket_mode: expected a mode that keeps the owner's read and write bits (0600), "
                "got '0060'"
            ),
        ),
        ("server:\n  socket_dir: 5\n", "server.socket_dir: expected an absolute path, got 5"),
        ("dram:\n  shm_dir: rel\n", "dram.shm_dir: expected an absolute path, got 'rel'"),
        (
            "metrics:\n  address: 9464\n",
            "metrics.address: expected 'host:port', '[ipv6]:port' or '' to disable, got 9464",
        ),
        (
            "metrics:\n  address:\n",
            "metrics.address: expected 'host:port', '[ipv6]:port' or '' to disable, got None",
        ),
    ],
)
def test_bad_values_have_exact_messages(tmp_path: Path, yaml_text: str, message: str) -> None:
    assert error_of(yaml_text, tmp_path) == f"{message} (from {tmp_path / 'kvtier.yaml'})"


def test_limits_are_inclusive(tmp_path: Path) -> None:
    cfg = load(
        "server:\n  max_message_bytes: 64KiB\n  max_keys_per_call: 1000000\n  grace: 0\n"
        "dram:\n  capacity: 1MiB\n  extent_size: 64KiB\n",
        tmp_path,
    )
    assert cfg.server.max_message_bytes == 64 * 1024
    assert cfg.server.max_keys_per_call == 1_000_000
    assert cfg.server.grace == 0.0
    assert (cfg.dram.capacity, cfg.dram.extent_size) == (1024**2, 64 * 1024)


def test_default_extent_shrinks_to_a_small_capacity() -> None:
    dram = load(overrides=["dram.capacity=16MiB"]).dram
    assert (dram.capacity, dram.extent_size) == (16 * 1024**2, 16 * 1024**2)


def test_default_extent_for_unaligned_small_capacity_is_page_aligned() -> None:
    dram = load(overrides=["dram.capacity=3000001"]).dram
    assert dram.extent_size % C.EXTENT_ALIGNMENT == 0
    assert dram.extent_size <= dram.capacity


@pytest.mark.parametrize(
    ("text", "mode"), [("0660", 0o660), ("600", 0o600), ("0o640", 0o640), ("0777", 0o777)]
)
def test_socket_mode_forms(text: str, mode: int) -> None:
    assert load(overrides=[f"server.socket_mode={text}"]).server.socket_mode == mode


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        ("127.0.0.1:9464", "127.0.0.1", 9464),
        ("0.0.0.0:0", "0.0.0.0", 0),
        ("localhost:65535", "localhost", 65535),
        ("metrics.example-host.internal:80", "metrics.example-host.internal", 80),
        ("[::1]:9464", "::1", 9464),
        ("[::]:0", "::", 0),
        ("[fe80::1%eth0]:9464", "fe80::1%eth0", 9464),
        ("", None, 0),
    ],
)
def test_metrics_address_forms(address: str, host: str | None, port: int) -> None:
    metrics = load(overrides=[f"metrics.address={address}"]).metrics
    assert metrics == MetricsConfig(address=address, host=host, port=port)


@pytest.mark.parametrize(
    "address",
    [
        "9464",
        ":9464",
        "host:",
        "host:65536",
        "host:-1",
        "host:http",
        "::1:9464",
        "[::1]",
        "[1.2.3.4]:80",
        "[nothost]:80",
        "a b:80",
        "host:80:80",
    ],
)
def test_bad_metrics_addresses(address: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(overrides=[f"metrics.address={address}"])
    assert str(info.value).startswith(
        "metrics.address: expected 'host:port', '[ipv6]:port' or '' to disable"
    )
    assert repr(address) in str(info.value)


def test_unbracketed_ipv6_gets_a_hint() -> None:
    with pytest.raises(ConfigError, match=r"put an IPv6 address in brackets"):
        load(overrides=["metrics.address=::1:9464"])


def test_log_level_is_case_insensitive_and_stored_lower() -> None:
    assert load(overrides=["log.level=DEBUG"]).log.level == "debug"


# ---------------------------------------------------------------------------
# Immutability and round trip
# ---------------------------------------------------------------------------


def test_config_is_frozen() -> None:
    cfg = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.instance = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.dram.capacity = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.metrics.port = 1  # type: ignore[misc]


def test_config_classes_use_slots() -> None:
    cfg = load()
    for obj in (cfg, cfg.server, cfg.dram, cfg.leases, cfg.reservations, cfg.metrics, cfg.log):
        assert not hasattr(obj, "__dict__"), type(obj).__name__


def test_config_is_hashable_and_comparable() -> None:
    assert hash(load()) == hash(load())


def test_config_to_dict_prints_sizes_and_durations_as_strings() -> None:
    d = config_to_dict(load())
    assert d["dram"]["capacity"] == "1GiB"
    assert d["dram"]["extent_size"] == "64MiB"
    assert d["server"]["max_message_bytes"] == "4MiB"
    assert d["server"]["socket_mode"] == "0660"
    assert d["server"]["grace"] == "2s"
    assert d["leases"]["ttl"] == "300s"
    assert d["metrics"] == {"address": "127.0.0.1:9464"}
    assert set(d) == set(C.TOP_LEVEL_KEYS)
    assert {s: set(v) for s, v in d.items() if isinstance(v, dict)} == {
        s: set(keys) for s, keys in C.SECTION_KEYS.items()
    }


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["instance=x", "server.grace=250ms", "server.socket_mode=0600", "dram.capacity=1000000000"],
        ["metrics.address=", "leases.ttl=0.25", "dram.mlock=false", "log.level=error"],
        ["metrics.address=[::1]:0", "reservations.ttl=1.25", "dram.extent_size=128KiB"],
        ["cluster.master=10.0.0.1:50051", "cluster.secret_file=/etc/kvtier/cluster.secret",
         "cluster.segment_bytes=4GiB", "cluster.write=commit", "cluster.replicas=2",
         "cluster.request_timeout=10s", "cluster.bind_address=10.0.0.2",
         "cluster.segment_owner=10.0.0.2:15077"],
        ["cluster.master=10.0.0.1:50051", "cluster.secret_file=/etc/kvtier/cluster.secret",
         "cluster.prefault_segment=false"],
    ],
)
def test_config_to_dict_round_trips_through_a_file(tmp_path: Path, overrides: list[str]) -> None:
    cfg = load(overrides=overrides)
    path = write(tmp_path, yaml.safe_dump(config_to_dict(cfg)))
    assert load_config(path, env=dict(BASE_ENV)) == cfg


def test_events_are_off_by_default_and_take_tcp_or_ipc_endpoints() -> None:
    assert not load().events.enabled
    ev = load(overrides=["events.endpoint=tcp://127.0.0.1:5557",
                         "events.replay_endpoint=ipc:///run/kvtier/replay.sock",
                         "events.buffer_batches=5"]).events
    assert (ev.enabled, ev.endpoint, ev.replay_endpoint, ev.buffer_batches) == (
        True, "tcp://127.0.0.1:5557", "ipc:///run/kvtier/replay.sock", 5)


@pytest.mark.parametrize("overrides, message", [
    (["events.endpoint=udp://x:1"], "events.endpoint: expected '', tcp://HOST:PORT or "
                                    "ipc:///absolute/path, got 'udp://x:1'"),
    (["events.endpoint=tcp://127.0.0.1:0"], "events.endpoint: expected"),
    (["events.endpoint=tcp://:5557"], "events.endpoint: expected"),
    (["events.endpoint=ipc://relative.sock"], "events.endpoint: expected"),
    (["events.replay_endpoint=ipc:///r.sock"], "events.replay_endpoint is set but "
                                               "events.endpoint is not"),
    (["events.endpoint=ipc:///e.sock", "events.replay_endpoint=ipc:///e.sock"],
     "events.endpoint and events.replay_endpoint must differ"),
    (["events.endpoint=ipc:///e.sock", "events.buffer_batches=0"],
     "events.buffer_batches: expected an integer in 1..1000000"),
])
def test_bad_events_settings_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as ei:
        load(overrides=overrides)
    assert message in str(ei.value)


def test_the_cluster_tier_is_off_by_default_and_needs_a_secret() -> None:
    assert not load().cluster.enabled
    cc = load(overrides=["cluster.master=mc-master:50051",
                         "cluster.secret_file=/etc/kvtier/cluster.secret"]).cluster
    assert cc.enabled and cc.protocol == "tcp" and cc.write == "demotion"
    assert cc.segment_bytes == 1 << 30 and cc.replicas == 1 and cc.prefault_segment
    with pytest.raises(ConfigError, match="cluster.secret_file"):
        load(overrides=["cluster.master=mc-master:50051"])


@pytest.mark.parametrize(("overrides", "message"), [
    (["cluster.master=no-port"], "cluster.master"),
    (["cluster.master=h:99999"], "cluster.master"),
    (["cluster.metadata_server=ftp://x"], "cluster.metadata_server"),
    (["cluster.protocol=udp"], "cluster.protocol"),
    (["cluster.write=always"], "cluster.write"),
    (["cluster.replicas=0"], "cluster.replicas"),
    (["cluster.request_timeout=0"], "cluster.request_timeout"),
    (["cluster.prefault_segment=sometimes"], "cluster.prefault_segment"),
    (["cluster.prefault_segment=1GiB"], "cluster.prefault_segment"),
    (["cluster.master=h:1", "cluster.secret_file=/s", "cluster.protocol=rdma"], "device_name"),
    (["cluster.master=h:1", "cluster.secret_file=/s", "spill.shared_dir=/mnt/lustre/kv"],
     "cluster.write: commit"),
])
def test_bad_cluster_settings_are_refused_with_their_name(overrides: list[str],
                                                          message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(overrides=overrides)


def test_the_cluster_segment_is_prefaulted_unless_turned_off(tmp_path: Path) -> None:
    base = ["cluster.master=mc:50051", "cluster.secret_file=/etc/kvtier/cluster.secret"]
    assert load(overrides=base).cluster.prefault_segment is True
    assert load(overrides=[*base, "cluster.prefault_segment=false"]).cluster.prefault_segment \
        is False
    path = write(tmp_path, "cluster:\n  prefault_segment: false\n")
    assert load_config(path, env=dict(BASE_ENV)).cluster.prefault_segment is False
    with pytest.raises(ConfigError, match="cluster.prefault_segment"):
        load_config(write(tmp_path, "cluster:\n  prefault_segment: 2\n"), env=dict(BASE_ENV))


# ---------------------------------------------------------------------------
# The schema: each key declared once; loading, dumping and the docs from it
# ---------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
RECORDED = Path(__file__).with_name("config_golden.json")
#: Messages the schema changed on purpose: the events endpoints are text keys now (every
#: key whose kind reads text is), so a value YAML reads as a number is quoted as written.
CHANGED = {
    "events.endpoint=5": "events.endpoint: expected '', tcp://HOST:PORT or ipc:///absolute/"
                         "path, got '5' (from override 'events.endpoint=5')",
    "events.replay_endpoint=7": "events.replay_endpoint: expected '', tcp://HOST:PORT or "
                                "ipc:///absolute/path, got '7' (from override "
                                "'events.replay_endpoint=7')",
}


def _recorded() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDED.read_text())
    return data


def _outcome(path: Path | None, env: Mapping[str, str], overrides: list[str]) -> dict[str, Any]:
    """What a load makes: its dump in the file's order, or its error."""
    try:
        cfg = load_config(path, env=dict(env), overrides=overrides)
    except ConfigError as exc:
        return {"error": str(exc)}
    return {"error": None, "dump": json.dumps(config_to_dict(cfg))}


def test_dumps_are_those_recorded_before_the_schema_key_for_key_and_in_order() -> None:
    rec = _recorded()
    for case in rec["dumps"]:
        path = ROOT / case["file"] if case["file"] else None
        got = _outcome(path, rec["base_env"], [*rec["fixed_overrides"], *case["overrides"]])
        assert got == {"error": None, "dump": json.dumps(case["dump"])}, case["name"]


def test_overrides_give_the_values_and_messages_recorded_before_the_schema() -> None:
    rec = _recorded()
    for case in rec["errors"]:
        got = _outcome(None, rec["base_env"], [*rec["fixed_overrides"], *case["overrides"]])
        expected = CHANGED.get(" ".join(case["overrides"]), case["error"])
        assert got["error"] == expected, case["overrides"]


def test_environment_gives_the_values_and_messages_recorded_before_the_schema() -> None:
    rec = _recorded()
    for case in rec["env_cases"]:
        got = _outcome(None, {**rec["base_env"], **case["env"]}, rec["fixed_overrides"])
        assert got["error"] == case["error"], case["env"]
        if case["error"] is None:
            assert got["dump"] == json.dumps(case["dump"]), case["env"]


def test_files_give_the_values_and_messages_recorded_before_the_schema(tmp_path: Path) -> None:
    rec = _recorded()
    for case in rec["files"]:
        path = write(tmp_path, case["text"], "c.yaml")
        got = _outcome(path, rec["base_env"], rec["fixed_overrides"])
        error = got["error"] and got["error"].replace(str(path), "FILE")
        assert error == case["error"], case["text"]
        if case["error"] is None:
            assert got["dump"] == json.dumps(case["dump"]), case["text"]


def test_docs_reference_table_is_what_the_schema_generates() -> None:
    text = (ROOT / C.REFERENCE_DOC).read_text()
    _, begin, rest = text.partition(C.REFERENCE_BEGIN + "\n")
    table, end, _ = rest.partition(C.REFERENCE_END)
    assert begin and end, f"the marker lines are missing from {C.REFERENCE_DOC}"
    assert table == C.reference_table(), "stale: run python scripts/config_reference.py"


def test_reference_lists_every_key_once_in_the_files_order() -> None:
    keys = re.findall(r"^\| `([a-z_.]+)` \|", C.reference_table(), re.M)
    assert keys == ["instance", *(f"{s}.{k}" for s, ks in C.SECTION_KEYS.items() for k in ks)]


def test_text_keys_are_the_keys_whose_kind_reads_text() -> None:
    before = {"instance", "server.socket_dir", "server.socket_mode", "dram.shm_dir",
              "spill.ssd_dir", "spill.shared_dir", "spill.shared_write", "metrics.address",
              "log.level", "log.format", "server.tcp_address", "server.tls_cert",
              "server.tls_key", "server.tls_client_ca", "server.tls_client_auth",
              "cluster.master", "cluster.metadata_server", "cluster.secret_file",
              "cluster.protocol", "cluster.device_name", "cluster.bind_address",
              "cluster.hostname", "cluster.write", "cluster.segment_owner"}
    assert C._TEXT_KEYS == before | {"events.endpoint", "events.replay_endpoint"}


def test_spill_policy_takes_its_defaults_and_values_from_the_config() -> None:
    from kvtierd.tiering import SpillPolicy

    # The values SpillPolicy restated as its own defaults before.
    assert SpillPolicy.with_defaults() == SpillPolicy(
        clean_ahead=0.1, queue_depth=256, backpressure_timeout=10.0, shared_write="demotion",
        cluster_write="demotion")
    assert SpillPolicy.with_defaults(queue_depth=1).queue_depth == 1
    cfg = load(overrides=["spill.clean_ahead=0.2", "spill.queue_depth=8",
                          "spill.backpressure_timeout=1500ms", "spill.shared_dir=/mnt/s",
                          "spill.shared_write=commit", "cluster.write=commit"])
    assert SpillPolicy.from_config(cfg.spill, cfg.cluster) == SpillPolicy(
        clean_ahead=0.2, queue_depth=8, backpressure_timeout=1.5, shared_write="commit",
        cluster_write="commit")


@pytest.mark.parametrize(("overrides", "agent"), [
    ([], {"master": "10.0.0.1:50051", "metadata_server": "http://10.0.0.1:8080/metadata",
          "protocol": "tcp", "device_name": "", "segment_bytes": 1 << 30, "segment_owner": "",
          "prefault_segment": True, "local_buffer_bytes": 16 << 20, "local_hostname": None,
          "replicas": 1, "threads": 4}),
    (["cluster.segment_owner=10.0.0.2:15077", "cluster.bind_address=10.0.0.2",
      "cluster.protocol=rdma", "cluster.device_name=mlx5_0", "cluster.replicas=3",
      "cluster.metadata_server=etcd://e:2379", "cluster.segment_bytes=4GiB",
      "cluster.hostname=h7"],
     {"master": "10.0.0.1:50051", "metadata_server": "etcd://e:2379", "protocol": "rdma",
      "device_name": "mlx5_0", "segment_bytes": 0, "segment_owner": "10.0.0.2:15077",
      "prefault_segment": False, "local_buffer_bytes": 16 << 20, "local_hostname": "h7",
      "replicas": 3, "threads": 4}),
])
def test_cluster_settings_give_the_agent_what_the_config_says(overrides: list[str],
                                                              agent: dict[str, Any]) -> None:
    """The agent's config as the daemon built it before ClusterSettings read the config."""
    from kvtierd.cluster.tier import ClusterSettings

    cc = load(overrides=["cluster.master=10.0.0.1:50051", "cluster.secret_file=/s",
                         *overrides]).cluster
    expected = {**agent, "local_hostname": agent["local_hostname"] or socket.gethostname()}
    assert ClusterSettings.from_config(cc).agent_config() == expected
