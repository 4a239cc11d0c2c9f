# syntax=docker/dockerfile:1
#
# kvtierd in a container.  Two stages:
#   build    compiles csrc/ and installs kvtier into the virtual environment
#            /opt/kvtier with scripts/install.sh -- the install path the
#            Makefile and CI use, so CI exercises this step on every run
#            (tests/test_packaging.py replays it without a Docker engine);
#   runtime  the same slim base, the venv copied in, no compiler, a non-root
#            user, a health check through the gRPC health service.
#
#   docker build -t kvtier .
#   docker run -d --name kvtierd --shm-size=9g --ulimit memlock=-1 \
#       -e KVTIER_DRAM_CAPACITY=8GiB -v kvtier-sock:/run/kvtier kvtier
#
# docs/deployment.md has both deployments (daemon on the host or in its own
# container) and how to size /dev/shm.

# Both stages must use the same image: the venv refers to the interpreter by
# its path (/usr/local/bin/python3.11), so build and runtime must agree on it.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# A C compiler for csrc/native.c.  The python:* images carry their own headers
# (/usr/local/include/python3.11); Debian's python3-dev would be for
# /usr/bin/python3, which is not the interpreter used here.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# MODE=wheel: a regular (non-editable) install, so /opt/kvtier holds the code
# and the compiled helpers and nothing under /src is needed at run time.
# EXTRAS= : no dev tools in the image.  The check after it fails the build if
# the install still points outside /opt/kvtier (an editable install).
RUN MODE=wheel EXTRAS= VENV=/opt/kvtier scripts/install.sh \
 && cd / \
 && /opt/kvtier/bin/python -c "import kvtier, kvtierd, kvtier._native as n; bad = [m.__file__ for m in (kvtier, kvtierd, n) if not m.__file__.startswith('/opt/kvtier/')]; assert not bad, f'kvtier is not self-contained in /opt/kvtier (editable install?): {bad}'"

FROM ${PYTHON_IMAGE} AS runtime
# A fixed numeric uid/gid so that volumes prepared on the host can be chowned to
# it, and so Kubernetes' runAsNonRoot can verify the user.
RUN groupadd --system --gid 10001 kvtier \
 && useradd --system --uid 10001 --gid kvtier --no-create-home \
        --home-dir /var/lib/kvtier --shell /usr/sbin/nologin kvtier \
 && install -d -o kvtier -g kvtier -m 0755 /run/kvtier \
 && install -d -o kvtier -g kvtier -m 0750 /var/lib/kvtier
COPY --from=build /opt/kvtier /opt/kvtier
# KVTIER_SOCKET_DIR is the rule daemon and clients share, so kvtierd, the health
# check and `docker exec kvtierd kvtier stats` all find /run/kvtier.
# Segments go to /dev/shm/kvtier: the container's /dev/shm (size it with
# --shm-size) or a memory-backed volume mounted at /dev/shm.
# Metrics listen on all addresses of the container's own network namespace:
# its 127.0.0.1 is unreachable from the host or from Prometheus, and nothing is
# exposed beyond the namespace unless published (-p) or scraped in the pod
# network.  With --network host, set KVTIER_METRICS_ADDRESS=127.0.0.1:9464.
ENV PATH=/opt/kvtier/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVTIER_SOCKET_DIR=/run/kvtier \
    KVTIER_DRAM_SHM_DIR=/dev/shm/kvtier \
    KVTIER_SPILL_SSD_DIR=/var/lib/kvtier/spill \
    KVTIER_METRICS_ADDRESS=0.0.0.0:9464
# The socket directory is what client containers share with the daemon; the SSD
# tier spills to /var/lib/kvtier/spill: mount the host's NVMe directory there.
VOLUME /run/kvtier
VOLUME /var/lib/kvtier
# Prometheus metrics (informational; publish with -p 9464:9464 if wanted).
EXPOSE 9464
USER 10001:10001
WORKDIR /var/lib/kvtier
# SERVING from grpc.health.v1 on the gRPC socket; any failure exits 1.
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD ["/opt/kvtier/bin/kvtier", "health"]
# kvtierd handles SIGTERM itself (it is PID 1 here): in-flight calls get
# server.grace (2 s), well inside `docker stop`'s 10 s.
ENTRYPOINT ["/opt/kvtier/bin/kvtierd"]
CMD []
