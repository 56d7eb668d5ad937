# Stand-in for python:3.12-slim where no image registry answers: Debian's python3 (3.11 on
# bookworm; the project needs >= 3.11) with `python` and `pip` on PATH like the official
# image (stage `base`), and pip pointed at the wheels of this build context (the project's
# dependencies as resolved by this python, at the host venv's pins, with the CPU build of
# torch), never at an index. Built by tests/compose/images.py; the context is the wheel folder.
ARG DEBIAN_IMAGE
FROM ${DEBIAN_IMAGE} AS base
LABEL org.inferq.standin=python
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        python3 python3-pip python-is-python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED
CMD ["python3"]

FROM base
COPY . /wheels
ENV PIP_FIND_LINKS=/wheels \
    PIP_NO_INDEX=1
