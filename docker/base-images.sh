#!/usr/bin/env bash
# Build, from Debian packages, the images `docker compose` needs, for a machine that cannot pull
# from Docker Hub (a registry mirror or an air-gapped network). Where `docker pull python:3.11-slim`
# works, none of this is needed: `docker compose up` builds and pulls what it uses.
#
#   sudo docker/base-images.sh >> .env     # the settings it prints go to compose's .env
#
# It makes four images:
#   bubbletea/debian:bookworm   debootstrap --variant=minbase with python3 (3.11, also as `python`) and CA
#                               certificates, plus this machine's extra CAs (a TLS-inspecting proxy's):
#                               the project image's RUNTIME (its final stage; no pip, no venv);
#   bubbletea/base:bookworm     that, plus python3-venv, pip and the local wheels (a CPU torch), if
#                               any: the project image's BASE (its build stage; pip finds the wheels
#                               before any index);
#   bubbletea/redis:7           the first with Debian's redis-server (7.0), for compose's redis;
#   bubbletea/prometheus:2      the first with Debian's prometheus, for the monitoring profile
#                               (the flags and paths of the prom/prometheus image).
# Grafana is not packaged by Debian: the monitoring profile's Grafana still needs its upstream image.
#
# Progress goes to stderr; stdout gets only the compose settings (BASE=..., RUNTIME=..., TORCH_INDEX=...,
# REDIS_IMAGE=..., PROMETHEUS_IMAGE=...). Settings (environment): SUITE (bookworm), MIRROR
# (http://deb.debian.org/debian), EXTRA_CA_DIR (/usr/local/share/ca-certificates), WHEELS
# (/opt/wheels: its *.whl go into the base image). Needs root (debootstrap), debootstrap and a
# running Docker engine. About a minute on 2 cores with a nearby mirror.
set -euo pipefail

SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
EXTRA_CA_DIR=${EXTRA_CA_DIR:-/usr/local/share/ca-certificates}
WHEELS=${WHEELS:-/opt/wheels}
DEBIAN_TAG=${DEBIAN_TAG:-bubbletea/debian:${SUITE}}
BASE_TAG=${BASE_TAG:-bubbletea/base:${SUITE}}
REDIS_TAG=${REDIS_TAG:-bubbletea/redis:7}
PROMETHEUS_TAG=${PROMETHEUS_TAG:-bubbletea/prometheus:2}

say() { echo "==> $*" >&2; }
die() { echo "base-images.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "debootstrap needs root: run it with sudo"
command -v debootstrap >/dev/null || die "debootstrap is not installed (Debian/Ubuntu: apt-get install debootstrap)"
docker info >/dev/null 2>&1 || die "no Docker engine answers (start dockerd, or check DOCKER_HOST)"

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
ROOTFS=$WORK/rootfs

# `docker build` from a Dockerfile on stdin (no context) or in a directory, quietly.
build() { docker build -q -t "$1" "${2:--}" >/dev/null 2>"$WORK/build.log" || { cat "$WORK/build.log" >&2; die "building $1 failed"; }; }

say "debootstrap $SUITE from $MIRROR"
debootstrap --variant=minbase --include=python3,python-is-python3,ca-certificates \
    "$SUITE" "$ROOTFS" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
    || { tail -20 "$WORK/debootstrap.log" >&2; die "debootstrap failed (its log above)"; }
if compgen -G "$EXTRA_CA_DIR/*.crt" >/dev/null; then
    say "adding the CA certificates in $EXTRA_CA_DIR"
    cp "$EXTRA_CA_DIR"/*.crt "$ROOTFS/usr/local/share/ca-certificates/"
    chroot "$ROOTFS" update-ca-certificates >/dev/null
fi
chroot "$ROOTFS" apt-get clean  # no package caches in the image
rm -rf "$ROOTFS"/var/lib/apt/lists/*

say "importing $DEBIAN_TAG"
# pip trusts the system's CA store (a proxy's CA included); Debian marks its Python as externally
# managed, which a container's single use does not need.
tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV PIP_BREAK_SYSTEM_PACKAGES=1' \
    --change 'CMD ["python3"]' \
    - "$DEBIAN_TAG" >/dev/null

say "building $BASE_TAG"
mkdir -p "$WORK/wheels"
printf '%s\n' "FROM $DEBIAN_TAG" \
    "RUN apt-get update && apt-get install -y --no-install-recommends python3-venv python3-pip \\" \
    "    && rm -rf /var/lib/apt/lists/*" \
    "ENV PIP_FIND_LINKS=/opt/wheels" >"$WORK/wheels/Dockerfile"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    say "  with the wheels in $WHEELS: $(cd "$WHEELS" && echo ./*.whl)"
    cp "$WHEELS"/*.whl "$WORK/wheels/"
    echo 'COPY *.whl /opt/wheels/' >>"$WORK/wheels/Dockerfile"
fi
build "$BASE_TAG" "$WORK/wheels"

say "building $REDIS_TAG"
printf '%s\n' "FROM $DEBIAN_TAG" \
    "RUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \\" \
    "    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data" \
    "WORKDIR /data" "USER redis" "EXPOSE 6379" 'CMD ["redis-server"]' | build "$REDIS_TAG"

say "building $PROMETHEUS_TAG"
printf '%s\n' "FROM $DEBIAN_TAG" \
    "RUN apt-get update && apt-get install -y --no-install-recommends prometheus \\" \
    "    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus && chown prometheus:prometheus /prometheus" \
    "USER prometheus" "EXPOSE 9090" 'ENTRYPOINT ["/usr/bin/prometheus"]' \
    'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]' | build "$PROMETHEUS_TAG"

docker images --format '{{.Repository}}:{{.Tag}}  {{.Size}}' \
    | grep -E "^(${DEBIAN_TAG}|${BASE_TAG}|${REDIS_TAG}|${PROMETHEUS_TAG}) " >&2 || true
# With a local torch wheel, torch's own dependencies come from PyPI (the PyTorch index is what such
# a network usually lacks); pip prefers the local 2.13.0+cpu to PyPI's 2.13.0.
index=https://download.pytorch.org/whl/cpu
if compgen -G "$WHEELS/torch-*.whl" >/dev/null; then index=https://pypi.org/simple; fi
say "done: the lines below go in compose's .env (next to REDIS_PASSWORD)"
printf 'BASE=%s\nRUNTIME=%s\nTORCH_INDEX=%s\nREDIS_IMAGE=%s\nPROMETHEUS_IMAGE=%s\n' \
    "$BASE_TAG" "$DEBIAN_TAG" "$index" "$REDIS_TAG" "$PROMETHEUS_TAG"
