# Stand-in for redis:7 where no image registry answers: Debian's redis-server (7.0 on
# bookworm) and redis-cli, started like the official image (working directory /data, the
# command's arguments as given). Built by tests/compose/images.py.
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
LABEL org.inferq.standin=redis
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
COPY redis-entrypoint.sh /usr/local/bin/redis-entrypoint.sh
WORKDIR /data
EXPOSE 6379
ENTRYPOINT ["/usr/local/bin/redis-entrypoint.sh"]
CMD ["redis-server"]
