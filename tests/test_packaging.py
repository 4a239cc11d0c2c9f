"""Deployment files: the systemd unit, sysusers/tmpfiles, the Dockerfile, the docs.

No systemd runs as PID 1 here and no Docker engine either, so:

* the unit goes through ``systemd-analyze verify`` (and an offline
  ``systemd-analyze security`` review) on a temp copy whose ExecStart names an
  executable that exists; any complaint about the unit fails the test, and a
  self-test checks that deliberately broken copies are reported;
* the Dockerfile is parsed and its build stage replayed: the build context is
  copied by ``.dockerignore``, the RUN line that calls ``scripts/install.sh`` is
  run with ``/opt/kvtier`` redirected to a temp folder, the sources are
  deleted (as in the runtime stage), and the image's ENTRYPOINT and
  HEALTHCHECK are run against each other.

The systemd checks need Debian's ``systemd`` package (``systemd-analyze``,
``systemd-sysusers``, ``systemd-tmpfiles``); they are skipped only when it is
not installed.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from kvtier._admin import wait_serving
from kvtierd.config import load_config
from tests.conftest import DaemonProc, stop_daemon

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "systemd" / "kvtierd.service"
SYSUSERS = ROOT / "systemd" / "kvtier.conf"
TMPFILES = ROOT / "systemd" / "kvtier.tmpfiles"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"
PRODUCTION_CONFIG = ROOT / "config" / "production.yaml"

#: Where the unit and the image expect the installed venv.
PREFIX = "/opt/kvtier"


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK)
                                  else None)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package 'systemd'; CI installs it)")
    return path


# --------------------------------------------------------------------------
# The unit file.
# --------------------------------------------------------------------------


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    """[Section] -> key -> every value assigned, in order (systemd allows repeats)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"setting outside a section: {raw!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _service() -> dict[str, list[str]]:
    return unit_settings(UNIT.read_text())["Service"]


def _last(settings: dict[str, list[str]], key: str) -> str:
    assert key in settings, f"{key}= missing from the unit"
    return settings[key][-1]


def _unit_environment() -> dict[str, str]:
    env: dict[str, str] = {}
    for value in _service().get("Environment", []):
        for item in shlex.split(value):
            k, _, v = item.partition("=")
            env[k] = v
    return env


def _verifiable_copy(tmp_path: Path, text: str | None = None) -> Path:
    """The unit (or ``text``) in a temp dir, ExecStart pointing at an existing kvtierd."""
    text = UNIT.read_text() if text is None else text
    installed = Path(sys.executable).with_name("kvtierd")
    exe = str(installed) if installed.exists() else "/bin/true"
    text = text.replace(f"ExecStart={PREFIX}/bin/kvtierd", f"ExecStart={exe}")
    path = tmp_path / "kvtierd.service"
    path.write_text(text)
    return path


def _verify(path: Path) -> tuple[int, list[str]]:
    """``systemd-analyze verify``: exit status and the complaints that name this unit.

    Unknown keys and unparsable values are only warnings (exit status 0), so
    the output matters as much as the status.  Lines about other units (the
    host's own unit files) are not ours to judge.
    """
    out = subprocess.run(
        [_tool("systemd-analyze"), "verify", "--man=no", "--recursive-errors=no", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    text = out.stdout + out.stderr
    return out.returncode, [ln for ln in text.splitlines() if path.name in ln]


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    rc, complaints = _verify(_verifiable_copy(tmp_path))
    assert rc == 0 and complaints == [], "\n".join(complaints)


@pytest.mark.parametrize(
    ("what", "old", "new"),
    [
        ("an unknown key", "NoNewPrivileges=yes", "NoNewPrivileges=yes\nNoNewPriviledges=yes"),
        ("a bad value", "WatchdogSec=30s", "WatchdogSec=thirty"),
        ("a missing executable", f"ExecStart={PREFIX}/bin/kvtierd",
         "ExecStart=/nonexistent/kvtierd"),
        ("a bad section", "[Service]", "[Servce]"),
    ],
)
def test_verify_reports_a_broken_unit(tmp_path: Path, what: str, old: str, new: str) -> None:
    """Self-test of the check above: each deliberate mistake is reported."""
    text = UNIT.read_text()
    assert old in text
    broken = text.replace(old, new, 1)
    if "nonexistent" in new:  # keep it: _verifiable_copy would otherwise repair ExecStart
        path = tmp_path / "kvtierd.service"
        path.write_text(broken)
    else:
        path = _verifiable_copy(tmp_path, broken)
    rc, complaints = _verify(path)
    assert rc != 0 or complaints, f"systemd-analyze verify missed {what}"


def test_unit_sandbox_exposure_stays_low(tmp_path: Path) -> None:
    """``systemd-analyze security``: 0 (locked down) .. 10 (exposed); the unit scores 1.5."""
    exe = _tool("systemd-analyze")
    path = _verifiable_copy(tmp_path)
    out = subprocess.run([exe, "security", "--offline=yes", "--threshold=20", str(path)],
                         capture_output=True, text=True, timeout=120, check=False)
    if "--offline" in out.stderr and "unrecognized" in out.stderr:
        pytest.skip("systemd-analyze older than 250: no offline security review")
    overall = [ln for ln in out.stdout.splitlines() if "Overall exposure" in ln]
    assert out.returncode == 0, "\n".join(overall) or out.stdout + out.stderr


def test_unit_keeps_what_the_daemon_depends_on() -> None:
    """Settings verify cannot judge: the protocol, the limits, and the warm cache's survival."""
    s = _service()
    assert _last(s, "Type") == "notify"
    assert _last(s, "NotifyAccess") == "main"
    assert _last(s, "ExecStart").split()[0] == f"{PREFIX}/bin/kvtierd"
    assert _last(s, "WatchdogSec") == "30s"
    assert _last(s, "Restart") == "on-failure"
    assert _last(s, "LimitMEMLOCK") == "infinity"
    assert int(_last(s, "LimitNOFILE")) >= 65536
    assert _last(s, "User") == _last(s, "Group") == "kvtier"
    assert _last(s, "CapabilityBoundingSet") == ""
    for key in ("NoNewPrivileges", "PrivateTmp", "ProtectHome", "ProtectKernelTunables",
                "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
                "RestrictNamespaces", "LockPersonality", "MemoryDenyWriteExecute"):
        assert _last(s, key) == "yes", key
    assert _last(s, "ProtectSystem") == "strict"
    # The segments live in /dev/shm and must outlive the service and be the host's:
    # a private /dev (PrivateDevices) or a dynamic user (implies RemoveIPC) would lose them.
    assert s.get("PrivateDevices", ["no"])[-1] == "no"
    assert s.get("DynamicUser", ["no"])[-1] == "no"
    assert s.get("RemoveIPC", ["no"])[-1] == "no"
    env = _unit_environment()
    shm_dir = env["KVTIER_DRAM_SHM_DIR"]
    assert shm_dir.startswith("/dev/shm/")
    assert any(shm_dir.startswith(p.lstrip("-").rstrip("/") + "/")
               for v in s["ReadWritePaths"] for p in v.split())
    # The sockets live in the RuntimeDirectory, kept across restarts for bind mounts.
    runtime = _last(s, "RuntimeDirectory")
    assert env["KVTIER_SERVER_SOCKET_DIR"] == f"/run/{runtime}"
    assert _last(s, "RuntimeDirectoryMode") == "0755"
    assert _last(s, "RuntimeDirectoryPreserve") == "yes"
    assert _last(s, "StateDirectory") == "kvtier"
    families = _last(s, "RestrictAddressFamilies").split()
    assert "AF_UNIX" in families  # the sockets and $NOTIFY_SOCKET
    # Exit status 2 is a config error; restarting cannot fix it.
    assert "2" in _last(s, "RestartPreventExitStatus").split()
    # The daemon's stop (server.grace, 2 s by default) fits in the stop timeout.
    assert int(_last(s, "TimeoutStopSec").rstrip("s")) >= 10


def test_unit_environment_is_valid_daemon_config() -> None:
    cfg = load_config(None, env=_unit_environment())
    assert cfg.server.socket_dir == "/run/kvtier"
    assert cfg.dram.shm_dir == "/dev/shm/kvtier"


def test_sysusers_and_tmpfiles_create_the_user_and_segment_dir(tmp_path: Path) -> None:
    sysusers, tmpfiles = _tool("systemd-sysusers"), _tool("systemd-tmpfiles")
    (tmp_path / "etc").mkdir()
    out = subprocess.run([sysusers, f"--root={tmp_path}", str(SYSUSERS)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "kvtier.conf" not in out.stderr, out.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text()
    group = (tmp_path / "etc" / "group").read_text()
    user = next(ln.split(":") for ln in passwd.splitlines() if ln.startswith("kvtier:"))
    assert int(user[2]) < 1000, "a system user (logind's RemoveIPC spares system users)"
    assert user[5] == "/var/lib/kvtier" and user[6].endswith("nologin")
    assert any(ln.startswith("kvtier:") for ln in group.splitlines())
    # tmpfiles claims exactly the unit's segment directory for the unit's user.
    fields = next(ln.split() for ln in TMPFILES.read_text().splitlines()
                  if ln.strip() and not ln.lstrip().startswith("#"))
    s = _service()
    assert fields[1] == _unit_environment()["KVTIER_DRAM_SHM_DIR"]
    assert fields[3] == _last(s, "User") and fields[4] == _last(s, "Group")
    assert fields[5] == "-", "no age: the segments must never be cleaned up"
    if os.geteuid() != 0:
        pytest.skip("creating the directory chowns it to kvtier, which needs root")
    out = subprocess.run([tmpfiles, f"--root={tmp_path}", "--create", str(TMPFILES)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    st = (tmp_path / fields[1].lstrip("/")).stat()
    assert (st.st_uid, st.st_mode & 0o7777) == (int(user[2]), 0o700)


def test_production_config_example_loads() -> None:
    cfg = load_config(PRODUCTION_CONFIG, env=_unit_environment())
    assert cfg.server.socket_dir == "/run/kvtier"
    assert cfg.dram.mlock


# --------------------------------------------------------------------------
# The Dockerfile.
# --------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """(stage index, INSTRUCTION, arguments) with continuation lines joined."""
    out: list[tuple[int, str, str]] = []
    stage = -1
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comments inside a continued instruction are dropped by Docker
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, args = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stage += 1
        out.append((stage, word, args.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def _docker() -> tuple[list[tuple[int, str, str]], int]:
    ins = dockerfile_instructions(DOCKERFILE.read_text())
    return ins, max(stage for stage, _, _ in ins)


def _stage_names() -> dict[str, int]:
    ins, _ = _docker()
    names: dict[str, int] = {}
    for stage, word, args in ins:
        if word == "FROM":
            m = re.search(r"\s+AS\s+(\S+)$", args, re.IGNORECASE)
            if m:
                names[m.group(1)] = stage
    return names


def _install_run() -> str:
    """The build stage's RUN that installs kvtier (through scripts/install.sh)."""
    ins, last = _docker()
    runs = [args for stage, word, args in ins
            if word == "RUN" and "scripts/install.sh" in args and stage < last]
    assert len(runs) == 1, "exactly one RUN in a build stage must call scripts/install.sh"
    return runs[0]


def _final(word: str) -> list[str]:
    ins, last = _docker()
    return [args for stage, w, args in ins if stage == last and w == word]


def _runtime_env() -> dict[str, str]:
    """ENV of the final stage (KEY=VALUE form, several per instruction)."""
    env: dict[str, str] = {}
    for args in _final("ENV"):
        for item in shlex.split(args):
            k, sep, v = item.partition("=")
            assert sep, f"use ENV KEY=VALUE, not {args!r}"
            env[k] = v.replace("$PATH", os.environ.get("PATH", ""))
    return env


def _exec_form(args: str) -> list[str]:
    """Parse a JSON exec-form argument (ENTRYPOINT, CMD, HEALTHCHECK ... CMD)."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(a, str) for a in value), args
    return value


def _healthcheck_cmd() -> list[str]:
    checks = _final("HEALTHCHECK")
    assert len(checks) == 1, "one HEALTHCHECK in the runtime stage"
    _, sep, cmd = checks[0].partition(" CMD ")
    assert sep, "HEALTHCHECK ... CMD [...] (exec form)"
    return _exec_form(cmd.strip())


def test_dockerfile_is_multi_stage_with_the_ci_install_path() -> None:
    ins, last = _docker()
    froms = [args for _, word, args in ins if word == "FROM"]
    assert len(froms) >= 2, "a build stage and a slim runtime stage"
    install = _install_run()
    assert "MODE=wheel" in install and f"VENV={PREFIX}" in install
    assert "EXTRAS= " in install, "no dev tools in the image"
    # The runtime stage takes the venv, not the sources, from the build stage ...
    builder = next(name for name, stage in _stage_names().items() if stage < last)
    copies = _final("COPY")
    assert f"--from={builder} {PREFIX} {PREFIX}" in copies, copies
    assert not any(c.startswith(". ") or c.startswith("./ ") for c in copies), copies
    # ... and has no compiler.
    assert not any("build-essential" in r or "gcc" in r for r in _final("RUN"))
    # Same base for both stages: the venv's interpreter path must exist at run time.
    bases = {args.split()[0] for args in froms}
    assert len(bases) == 1, bases


def test_dockerfile_runs_as_non_root_with_healthcheck_and_entrypoint() -> None:
    users = _final("USER")
    assert users, "the runtime stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), users
    assert _exec_form(_final("ENTRYPOINT")[-1]) == [f"{PREFIX}/bin/kvtierd"]
    assert _healthcheck_cmd() == [f"{PREFIX}/bin/kvtier", "health"]
    env = _runtime_env()
    assert env["KVTIER_SOCKET_DIR"] == "/run/kvtier"
    assert env["KVTIER_DRAM_SHM_DIR"].startswith("/dev/shm/")
    assert "/run/kvtier" in " ".join(_final("VOLUME"))
    load_config(None, env=env)  # every KVTIER_* the image sets is a valid key and value


def test_dockerfile_healthcheck_reports_serving_and_failure(workdir: str) -> None:
    """The image's health check and the doc's probe, against a real daemon and against none."""
    checks = {"Dockerfile HEALTHCHECK": _healthcheck_cmd(), "docs: livenessProbe": _doc_probe()}
    local = {f"{PREFIX}/bin/python": [sys.executable],
             f"{PREFIX}/bin/kvtier": [sys.executable, "-m", "kvtier.cli"]}
    checks = {name: [b for a in cmd for b in local.get(a, [a])] for name, cmd in checks.items()}
    d = _start_like_the_image(workdir, [sys.executable, "-m", "kvtierd"], {})
    try:
        env = {**_image_env(workdir, d.shm_dir), "PATH": os.environ.get("PATH", "")}
        for name, cmd in checks.items():
            ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60,
                                check=False)
            assert ok.returncode == 0, f"{name}: {ok.stderr}"
    finally:
        stop_daemon(d)
    for name, cmd in checks.items():
        down = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60,
                              check=False)
        assert down.returncode == 1, f"{name}: {down.stderr}"  # Docker: 1 = unhealthy


def _doc_probe() -> list[str]:
    """The exec livenessProbe of the Kubernetes example in docs/deployment.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", DEPLOYMENT_DOC.read_text(), re.S)
    pods = [yaml.safe_load(b) for b in blocks]
    pod = next(p for p in pods if isinstance(p, dict) and p.get("kind") == "Pod")
    daemon = next(c for c in pod["spec"]["containers"] if c["image"].startswith("kvtier"))
    cmd = daemon["livenessProbe"]["exec"]["command"]
    assert isinstance(cmd, list) and all(isinstance(a, str) for a in cmd)
    return cmd


def dockerignore_patterns() -> list[str]:
    pats = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            assert not line.startswith("!"), "exceptions are not supported by this test's copy"
            pats.append(line.strip("/"))
    return pats


def ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule for the subset used here: ``name``/``a/b`` from the root, ``**/glob``."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pat in patterns:
        if pat.startswith("**/"):
            tail = pat[3:]
            if any(fnmatch.fnmatchcase(p, tail) for p in parts):
                return True
        elif any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            return True
    return False


def copy_build_context(dest: Path) -> list[str]:
    """Copy the repository as ``docker build .`` would send it; returns the files copied."""
    patterns = dockerignore_patterns()
    copied = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel_dir = os.path.relpath(dirpath, ROOT)
        rel_dir = "" if rel_dir == "." else rel_dir
        dirnames[:] = [n for n in dirnames if not ignored(os.path.join(rel_dir, n), patterns)]
        for name in filenames:
            rel = os.path.join(rel_dir, name)
            if ignored(rel, patterns):
                continue
            (dest / rel_dir).mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel, follow_symlinks=False)
            copied.append(rel)
    return copied


def test_build_context_has_sources_and_nothing_built() -> None:
    patterns = dockerignore_patterns()
    for needed in ("pyproject.toml", "setup.py", "README.md", "scripts/install.sh",
                   "csrc/native.c", "client/kvtier/__init__.py", "daemon/kvtierd/__main__.py",
                   "client/kvtier/v1/kvtier_pb2.py"):
        assert not ignored(needed, patterns), f".dockerignore drops {needed}"
    for junk in (".venv/bin/python", ".venv-jax/bin/python", ".venv-vllm-tpu/bin/python",
                 ".git/HEAD", "client/kvtier/_native.cpython-311-x86_64-linux-gnu.so",
                 "kvtier.egg-info/PKG-INFO", "build/lib/x.py", "daemon/kvtierd/__pycache__/app.pyc",
                 "tests/conftest.py"):
        assert ignored(junk, patterns), f".dockerignore lets {junk} into the image build"


def _image_env(workdir: str, shm_dir: str) -> dict[str, str]:
    """The runtime stage's ENV with the container's paths moved into temp dirs."""
    env = _runtime_env()
    env.update({
        "KVTIER_SOCKET_DIR": os.path.join(workdir, "sock"),
        "KVTIER_DRAM_SHM_DIR": shm_dir,
        "KVTIER_SPILL_SSD_DIR": os.path.join(workdir, "spill"),
        "KVTIER_METRICS_ADDRESS": "127.0.0.1:0",
        "KVTIER_DRAM_CAPACITY": "32MiB",
        "KVTIER_DRAM_EXTENT_SIZE": "4MiB",
    })
    return env


def _start_like_the_image(workdir: str, entrypoint: list[str], extra_env: dict[str, str],
                          cwd: str = "/") -> DaemonProc:
    shm_dir = f"/dev/shm/kvtier-test-{uuid.uuid4().hex[:12]}"
    env = {**_image_env(workdir, shm_dir), **extra_env}
    log_path = os.path.join(workdir, "kvtierd-image.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(entrypoint, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=cwd, text=True)
    d = DaemonProc(proc, env["KVTIER_SOCKET_DIR"], shm_dir, log_path, entrypoint)
    try:
        wait_serving(d.socket_dir, proc)
    except BaseException:
        stop_daemon(d)
        print(d.log(), file=sys.stderr)
        raise
    return d


def test_docker_build_stage_replayed_without_docker(workdir: str) -> None:
    """The build stage's install RUN on the build context; then the runtime stage's commands.

    Installs from the package index (as CI's own install does): about a
    minute without a warm pip cache.
    """
    if "MODE" not in (ROOT / "scripts" / "install.sh").read_text():
        pytest.skip("scripts/install.sh has no MODE=wheel yet: the image cannot be built "
                    "(docs/deployment.md)")
    context, prefix = Path(workdir) / "src", Path(workdir) / "opt-kvtier"
    context.mkdir()
    copy_build_context(context)
    run = _install_run().replace(PREFIX, str(prefix))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "VIRTUAL_ENV", "PYTHONPATH"))}
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", run], cwd=context, env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    # Runtime stage: only the venv is copied; the sources are gone.
    shutil.rmtree(context)
    entry = [a.replace(PREFIX, str(prefix)) for a in _exec_form(_final("ENTRYPOINT")[-1])]
    d = _start_like_the_image(workdir, entry, {})
    try:
        stats = subprocess.run([str(prefix / "bin" / "kvtier"), "stats", "--json"],
                               env=_image_env(workdir, d.shm_dir), cwd="/", capture_output=True,
                               text=True, timeout=60, check=False)
        assert stats.returncode == 0, stats.stderr
        health = [a.replace(PREFIX, str(prefix)) for a in _healthcheck_cmd()]
        ok = subprocess.run(health, env=_image_env(workdir, d.shm_dir), cwd="/",
                            capture_output=True, text=True, timeout=60, check=False)
        assert ok.returncode == 0, ok.stderr
        d.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        d.proc.wait(15)
        assert d.proc.returncode == 0 and time.monotonic() - t0 < 10, d.log()
    finally:
        stop_daemon(d)


# --------------------------------------------------------------------------
# The deployment guide.
# --------------------------------------------------------------------------


def test_deployment_doc_covers_both_deployments_and_sizing() -> None:
    doc = DEPLOYMENT_DOC.read_text()
    # Host daemon, client containers mount only the socket directory.
    assert "-v /run/kvtier:/run/kvtier" in doc
    assert "systemctl daemon-reload" in doc and "systemctl enable --now kvtierd" in doc
    assert "systemd-sysusers" in doc
    # Daemon in its own container / pod with a memory-backed volume.
    assert "medium: Memory" in doc and "sizeLimit" in doc and "emptyDir" in doc
    # Sizing and locking caveats.
    assert "--shm-size" in doc and "64 MiB" in doc
    assert "--ulimit memlock=-1" in doc and "memory locked: NO" in doc
    # The paths the doc gives are the unit's and the image's.
    assert f"{PREFIX}/bin/kvtierd" in doc and "/etc/kvtier/kvtier.yaml" in doc
    assert "MODE=wheel" in doc
