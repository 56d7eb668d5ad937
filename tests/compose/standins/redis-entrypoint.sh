#!/bin/sh
# As the official redis image: a redis-server started without a config file gets
# --protected-mode no, since the container's port is reachable only where it is published
# or on its compose network (with protected mode on, Redis refuses every client that is not
# on loopback when it has no password).
set -e
if [ "$1" = redis-server ] && [ ! -f "${2:-}" ]; then
    set -- "$@" --protected-mode no
fi
exec "$@"
