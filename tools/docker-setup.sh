#!/usr/bin/env bash
# A Docker engine for the `docker` tests (tests/deploy/test_compose_up.py) on a Debian host, as
# root. Idempotent: each step runs only when its result is missing.
#   1. docker.io (+ debootstrap for step 4) from Debian, when dockerd is not installed;
#   2. dockerd started in the background, when `docker info` fails;
#   3. Compose v2 as `docker-compose` (Debian's package, unpacked), when missing;
#   4. the base images compose.yaml and docker/*.Dockerfile name: pulled when a registry answers,
#      else built locally: python:3.11-slim = Debian bookworm (debootstrap) + python3, venv, pip,
#      this host's CA bundle (a proxy with its own CA may sit between it and the package index);
#      redis:7-alpine = that image + Debian's redis-server (started like the official image).
# Build with the classic builder (DOCKER_BUILDKIT=0): BuildKit fetches its frontend from Docker
# Hub. Log: /tmp/deltarl-docker-setup.log.
set -euo pipefail
LOG=/tmp/deltarl-docker-setup.log
export DEBIAN_FRONTEND=noninteractive
say() { echo "docker-setup: $*"; }

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  say "installing docker.io and debootstrap"
  apt-get update -qq >>"$LOG" 2>&1
  apt-get install -y -qq docker.io debootstrap >>"$LOG" 2>&1
fi

if ! docker info >/dev/null 2>&1; then
  say "starting dockerd"
  (setsid dockerd >>/tmp/deltarl-dockerd.log 2>&1 &)
  for _ in $(seq 90); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { say "dockerd did not start (/tmp/deltarl-dockerd.log)"; exit 1; }
fi

if ! docker-compose version 2>/dev/null | grep -q 'v\?2\.' && ! docker compose version >/dev/null 2>&1; then
  say "installing Compose v2"
  tmp=$(mktemp -d)
  # Compose v2 is Debian's docker-compose from trixie on (bookworm's is v1): fetch it from trixie
  mkdir -p "$tmp/lists"
  echo 'deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian trixie main' >"$tmp/sources.list"
  apt_o="-oDir::Etc::SourceList=$tmp/sources.list -oDir::Etc::SourceParts=/dev/null -oDir::State::Lists=$tmp/lists"
  # shellcheck disable=SC2086
  apt-get $apt_o update -qq >>"$LOG" 2>&1
  # shellcheck disable=SC2086
  (cd "$tmp" && apt-get $apt_o download docker-compose >>"$LOG" 2>&1)
  dpkg -x "$tmp"/docker-compose_*.deb "$tmp/x"
  plugin=$(find "$tmp/x" -path '*cli-plugins/docker-compose' -type f | head -1)
  [ -n "$plugin" ] || { say "no Compose v2 in Debian's docker-compose package"; exit 1; }
  install -m 755 "$plugin" /usr/local/bin/docker-compose
  mkdir -p /usr/local/lib/docker/cli-plugins && ln -sf /usr/local/bin/docker-compose /usr/local/lib/docker/cli-plugins/docker-compose
  rm -rf "$tmp"
fi

have() { docker image inspect "$1" >/dev/null 2>&1; }
pull() { timeout 60 docker pull -q "$1" >>"$LOG" 2>&1; }

if ! have python:3.11-slim && ! pull python:3.11-slim; then
  say "building a local python:3.11-slim (Debian bookworm + python3)"
  root=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$root/fs" http://deb.debian.org/debian >>"$LOG" 2>&1
  ln -sf /usr/bin/python3 "$root/fs/usr/local/bin/python"
  ln -sf /usr/bin/pip3 "$root/fs/usr/local/bin/pip"
  rm -f "$root"/fs/usr/lib/python3.*/EXTERNALLY-MANAGED
  cp /etc/ssl/certs/ca-certificates.crt "$root/fs/etc/ssl/certs/ca-certificates.crt"
  printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$root/fs/etc/pip.conf"
  tar -C "$root/fs" -c . | docker import \
    -c 'ENV LANG=C.UTF-8' -c 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    -c 'CMD ["python3"]' - python:3.11-slim >/dev/null
  rm -rf "$root"
fi

if ! have redis:7-alpine && ! pull redis:7-alpine; then
  say "building a local redis:7-alpine (Debian's redis-server)"
  ctx=$(mktemp -d)
  cat >"$ctx/entry.sh" <<'SH'
#!/bin/sh
# like the official image: `redis-server ARGS` runs without protected mode
if [ "$1" = redis-server ]; then shift; exec redis-server --protected-mode no "$@"; fi
exec "$@"
SH
  chmod +x "$ctx/entry.sh"
  cat >"$ctx/Dockerfile" <<'DF'
FROM python:3.11-slim
RUN apt-get update -qq && apt-get install -y -qq redis-server >/dev/null && rm -rf /var/lib/apt/lists/*
COPY entry.sh /entry.sh
WORKDIR /data
ENTRYPOINT ["/entry.sh"]
CMD ["redis-server"]
DF
  DOCKER_BUILDKIT=0 docker build -q -t redis:7-alpine "$ctx" >>"$LOG" 2>&1
  rm -rf "$ctx"
fi

say "ready: docker $(docker version --format '{{.Server.Version}}'), $(docker-compose version --short 2>/dev/null || docker compose version --short)"
