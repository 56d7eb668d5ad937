# Stand-in for prom/prometheus where no image registry answers: Debian's prometheus (2.42
# on bookworm), with the official image's entrypoint (the compose command gives only the
# flags) and its default flags. Built by tests/compose/images.py.
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE}
LABEL org.inferq.standin=prometheus
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
