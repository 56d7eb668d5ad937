"""Every Redis key and channel name inferq uses, in one place.

All names start with a configurable namespace (default ``inferq``) so several
deployments can share one Redis. The TTLs that go with some keys live here too.

| name | type | written by | read by |
| --- | --- | --- | --- |
| ``{ns}:{model}:requests`` | stream | gateway (XADD) | workers (XREADGROUP, group ``workers``) |
| ``{ns}:gateway:{gateway_id}`` | pub/sub channel | workers (token/error messages) | the gateway that owns the requests |
| ``{ns}:control`` | pub/sub channel | gateways (aborts) | every worker |
| ``{ns}:worker:{worker_id}`` | string with TTL | worker (heartbeat + status) | gateways, ``inferq queues`` |
| ``{ns}:request-id:{request_id}`` | string with TTL | gateway (SET NX with the XADD; DEL when the request ends) | gateways (duplicate check) |
"""

from __future__ import annotations

from dataclasses import dataclass

#: Consumer group every worker of a model joins on the model's request stream.
CONSUMER_GROUP = "workers"
#: Field of a stream entry that holds the msgpack-encoded request.
STREAM_FIELD = b"m"
#: A worker refreshes its heartbeat every ``HEARTBEAT_INTERVAL_S``; the key expires
#: after ``HEARTBEAT_TTL_S`` so a worker killed with SIGKILL disappears within it.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 5


@dataclass(frozen=True, slots=True)
class Keys:
    """Key and channel names under one namespace."""

    namespace: str = "inferq"

    def requests_stream(self, model: str) -> str:
        """Stream that holds the requests for ``model``."""
        return f"{self.namespace}:{model}:requests"

    def gateway_channel(self, gateway_id: str) -> str:
        """Pub/sub channel on which one gateway receives token and error messages."""
        return f"{self.namespace}:gateway:{gateway_id}"

    def control_channel(self) -> str:
        """Pub/sub channel of control messages (aborts) for all workers."""
        return f"{self.namespace}:control"

    def worker_key(self, worker_id: str) -> str:
        """Heartbeat key of one worker; its value is an encoded ``WorkerStatus``."""
        return f"{self.namespace}:worker:{worker_id}"

    def request_id_key(self, request_id: str) -> str:
        """Marks a client-supplied request id as in flight (value: the request's wire id)
        until the request ends, at most for the request's timeout: the same id does not
        run twice at once (``gateway/request_ids.py``)."""
        return f"{self.namespace}:request-id:{request_id}"

    def worker_pattern(self) -> str:
        """SCAN pattern that matches every worker heartbeat key."""
        return f"{self.namespace}:worker:*"
