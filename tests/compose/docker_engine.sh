#!/usr/bin/env bash
# Make a Docker engine answer on this machine for the compose test (tests/test_compose_up.py):
# install Debian's docker.io (with debootstrap, which builds the stand-in base image) where
# dockerd is missing, and start dockerd in the background where none answers. Idempotent:
# with an engine already answering it only says so. Needs root to install or to start.
#
# Prints one line on success; on failure one line "docker_engine: ..." on stderr, exit 1.
# dockerd's log: $INFERQ_DOCKERD_LOG (default /var/log/inferq-dockerd.log).
set -euo pipefail

LOG=${INFERQ_DOCKERD_LOG:-/var/log/inferq-dockerd.log}
START_TIMEOUT_S=${INFERQ_DOCKERD_START_TIMEOUT_S:-60}

fail() { echo "docker_engine: $*" >&2; exit 1; }

answers() { command -v docker >/dev/null && docker info >/dev/null 2>&1; }

need_root() {
    [ "$(id -u)" = 0 ] || fail "$1 needs root (running as $(id -un)); run this script as root or start dockerd yourself"
}

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null || ! command -v docker >/dev/null; then
    need_root "installing docker.io and debootstrap"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null 2>&1 || fail "apt-get update failed: no Debian package mirror reachable?"
    apt-get install -y -qq --no-install-recommends docker.io debootstrap >/dev/null 2>&1 \
        || fail "apt-get install docker.io debootstrap failed"
fi

if answers; then
    echo "docker engine: running ($(docker version --format '{{.Server.Version}}' 2>/dev/null))"
    exit 0
fi

need_root "starting dockerd"
# A dockerd that was killed leaves its pid file; dockerd refuses to start while the pid in
# it names a live process, which after a restart may be any process.
PIDFILE=/var/run/docker.pid
if [ -f "$PIDFILE" ] && [ "$(cat "/proc/$(cat "$PIDFILE")/comm" 2>/dev/null)" != dockerd ]; then
    rm -f "$PIDFILE"
fi
# setsid: dockerd outlives this script and the test run that called it (other runs reuse it).
setsid dockerd >>"$LOG" 2>&1 </dev/null &
for _ in $(seq "$START_TIMEOUT_S"); do
    if answers; then
        echo "docker engine: started dockerd $(docker version --format '{{.Server.Version}}') (pid $!, log $LOG)"
        exit 0
    fi
    kill -0 $! 2>/dev/null || fail "dockerd exited at start: $(tail -n 1 "$LOG")"
    sleep 1
done
fail "dockerd did not answer within ${START_TIMEOUT_S} s: $(tail -n 1 "$LOG")"
