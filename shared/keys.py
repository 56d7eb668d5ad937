"""Every Redis key and channel name inferq uses, in one place.

All names start with a configurable namespace (default ``inferq``) so several
deployments can share one Redis. The TTLs that go with some keys live here too.

Every key of one model starts with ``{ns}:{{model}}:``: the model name inside literal
braces, its hash tag. A Redis Cluster puts a key whose name holds ``{...}`` in the hash
slot of the part between the braces, so all of one model's streams, sets and hashes
share a slot (one shard), and different models spread over the shards. Each Lua script
touches the keys of one model only (the enqueue script's request-id key is the model's
too), which a cluster requires of a script. The namespace holds no braces. Keys that
belong to no model (heartbeats, files, batches, stored responses) are read with one command per key or per
slot (``shared.redis_connect.mget``); pub/sub channels are not keys and live on every node.
In the table, ``{{model}}`` is the model name in braces and every other ``{...}`` a value.

| name | type | written by | read by |
| --- | --- | --- | --- |
| ``{ns}:{{model}}:requests`` | stream: class ``default``, tenant ``anonymous`` | gateway (enqueue script) | workers (pull script: XREADGROUP, group ``workers``) |
| ``{ns}:{{model}}:requests:{class}:{tenant}`` | stream: every other (class, tenant) | gateway (enqueue script) | workers (pull script) |
| ``{ns}:{{model}}:queues`` | set of the model's stream keys | gateway (enqueue script), workers (base stream) | workers (reap), admission depth, ``inferq queues`` |
| ``{ns}:{{model}}:active:{class}`` | sorted set: streams with waiting entries, scored by their tenant's virtual token counter | enqueue script (join), pull script (charge, leave) | pull script, ``inferq queues`` |
| ``{ns}:{{model}}:doorbell`` | list (at most ``DOORBELL_MAX_RINGS``) | enqueue script (RPUSH) | idle workers (BLPOP), pull script (DEL when all is taken) |
| ``{ns}:{{model}}:placed:{worker_id}:{class}`` | stream: requests the gateway placed on one worker, per class | gateway (enqueue script) | that worker first (pull script), an idle worker after ``steal_after_ms``, any live worker once it is dead |
| ``{ns}:{{model}}:doorbell:{worker_id}`` | list: rings for one worker's placed streams | enqueue script (RPUSH) | that worker (BLPOP, beside the model's doorbell) |
| ``{ns}:{{model}}:placed-tokens`` | hash: worker id -> prefill tokens waiting in its placed streams | enqueue script (HINCRBY), pull script (HINCRBY -) | gateways (placement) |
| ``{ns}:{{model}}:placed-requests`` | hash: worker id -> requests waiting in its placed streams | enqueue script (HINCRBY), pull script (HINCRBY -1) | gateways (placement) |
| ``{ns}:{{model}}:load`` | hash: worker id -> prompt tokens it holds uncomputed | that worker (HSET in its step pipeline, when changed) | gateways (placement script) |
| ``{ns}:{{model}}:held`` | hash: worker id -> requests it holds (running + waiting) | that worker (pull script HSET, with what it took; HSET when it changed without a pull) | gateways (placement script) |
| ``{ns}:{{model}}:kv:{worker_id}`` | set of 16-byte block hashes (``shared/block_hashes.py``) one worker's prefix cache holds | that worker (KV events: SADD stored, SREM removed, per step; DEL + SADD of its whole cache every ``KV_INDEX_RESYNC_S``), gateways (SADD a placed prompt's blocks) | gateways (placement script) |
| ``{ns}:gateway:{gateway_id}`` | pub/sub channel | workers (token/error messages) | the gateway that owns the requests |
| ``{ns}:control`` | pub/sub channel | gateways (aborts) | every worker |
| ``{ns}:{{model}}:arrivals`` | pub/sub channel: ``<class rank>:<tenant>`` of each request queued in a class above the lowest | enqueue script (PUBLISH) | workers of the model (``worker/engine/arrivals.py``) |
| ``{ns}:worker:{worker_id}`` | string with TTL | worker (heartbeat + status) | gateways, ``inferq queues`` |
| ``{ns}:{{model}}:request-id:{tenant}:{request_id}`` | string with TTL | gateway (SET NX with the XADD; DEL when the request ends) | gateways (duplicate check, per key tenant) |
| ``{ns}:server-secret`` | string (64 hex characters), set once (SET NX) | the first gateway or batch worker that needs it | gateways (tenant ids, the batch credential), batch workers (``shared/server_secret.py``) |
| ``{ns}:{{model}}:rate-limit:{tenant}`` | hash with TTL | gateways (one Lua script: gateway/rate_limits.py) | the same script |
| ``{ns}:file:{file_id}`` | string (JSON file object) | gateway (upload), batch worker (output files) | gateways |
| ``{ns}:files`` | sorted set (file id by creation time) | as above | gateways (``GET /v1/files``) |
| ``{ns}:files:owner:{tenant}`` | sorted set: the files of one owner (key tenant) | as above | gateways (``GET /v1/files`` of a non-admin key) |
| ``{ns}:response:{response_id}`` | string with TTL (``responses_ttl_s``): a stored response, its owner and its conversation (``gateway/response_store.py``) | gateway (``POST /v1/responses`` with ``store``) | gateways (``GET``/``DELETE /v1/responses/{id}``, ``previous_response_id``) |
| ``{ns}:batch:{batch_id}`` | hash (batch object fields, JSON values) | gateway (create, cancel), batch worker | gateways, batch workers |
| ``{ns}:batches`` / ``{ns}:batches:active`` | sorted set / set of batch ids | gateway (create), batch worker (active: removed when done) | gateways (list), batch workers (resume) |
| ``{ns}:batches:owner:{tenant}`` | sorted set: the batches of one owner (key tenant) | gateway (create) | gateways (``GET /v1/batches`` of a non-admin key) |
| ``{ns}:batch:{batch_id}:results`` | hash (custom_id -> result line) | batch worker (HSETNX: one result per line) | batch worker (resume, output files) |
| ``{ns}:batch:{batch_id}:lease`` | string with TTL | the batch worker running the batch | batch workers (resume) |
| ``{ns}:batch:{batch_id}:resumed`` | string with TTL | batch workers (``resume_batches``) | batch workers (one resume job at a time) |
| ``{ns}:arq:queue`` (+ arq's own ``arq:job:*``, ``arq:in-progress:*`` keys) | arq's sorted set of batch jobs | gateway (enqueue), batch workers (cron) | batch workers |
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
#: Tenant of requests without an API key (``gateway/tenants.py``); with the ``default``
#: class its stream is the model's base stream ``{ns}:{{model}}:requests``.
ANONYMOUS_TENANT = "anonymous"
#: Priority class whose anonymous tenant uses the base stream (``shared/fair_queue.py``).
BASE_CLASS = "default"


@dataclass(frozen=True, slots=True)
class Keys:
    """Key and channel names under one namespace (which holds no ``{`` or ``}``)."""

    namespace: str = "inferq"

    def _model(self, model: str) -> str:
        """``{ns}:{<model>}``: what every key of ``model`` starts with. The braces make the
        model name the key's hash tag, so a Redis Cluster keeps all of a model's keys in
        one hash slot, as its Lua scripts need (module docstring)."""
        return f"{self.namespace}:{{{model}}}"

    def requests_stream(self, model: str) -> str:
        """Stream that holds the requests for ``model``."""
        return f"{self._model(model)}:requests"

    def class_stream(self, model: str, priority_class: str, tenant: str) -> str:
        """Stream of one (priority class, tenant) of ``model`` (``shared/fair_queue.py``):
        the base stream ``requests_stream(model)`` for class ``default`` and tenant
        ``anonymous`` (so a deployment without keys or classes keeps one stream), else
        ``{ns}:{{model}}:requests:{class}:{tenant}`` (class names hold no ``:``, so the part
        after the class is the tenant)."""
        if priority_class == BASE_CLASS and tenant == ANONYMOUS_TENANT:
            return self.requests_stream(model)
        return f"{self.requests_stream(model)}:{priority_class}:{tenant}"

    def model_streams(self, model: str) -> str:
        """Set of every stream key of ``model`` (the base stream and each class_stream used)."""
        return f"{self._model(model)}:queues"

    def model_streams_pattern(self) -> str:
        """SCAN pattern that matches every model's ``model_streams`` set."""
        return f"{self.namespace}:{{*}}:queues"

    def active_streams(self, model: str, priority_class: str) -> str:
        """Sorted set of the class's streams that may hold waiting entries, each scored by
        its tenant's virtual token counter (``shared/fair_queue.py``)."""
        return f"{self._model(model)}:active:{priority_class}"

    def doorbell(self, model: str) -> str:
        """List that idle workers of ``model`` block on (BLPOP): one ring per enqueue."""
        return f"{self._model(model)}:doorbell"

    def placed_stream(self, model: str, worker_id: str, priority_class: str) -> str:
        """Stream of the requests of class ``priority_class`` that gateways placed on
        worker ``worker_id`` (``gateway/placement.py``); read by the consumer group
        ``workers`` like every request stream (docs/architecture.md, "Placement")."""
        return f"{self._model(model)}:placed:{worker_id}:{priority_class}"

    def placed_prefix(self, model: str) -> str:
        """What every ``placed_stream`` of ``model`` starts with (then ``{worker_id}:{class}``)."""
        return f"{self._model(model)}:placed:"

    def worker_doorbell(self, model: str, worker_id: str) -> str:
        """List that worker ``worker_id`` blocks on beside ``doorbell``: one ring per
        request placed on it."""
        return f"{self._model(model)}:doorbell:{worker_id}"

    def placed_tokens(self, model: str) -> str:
        """Hash worker id -> prefill tokens waiting (undelivered) in its placed streams."""
        return f"{self._model(model)}:placed-tokens"

    def placed_requests(self, model: str) -> str:
        """Hash worker id -> requests waiting (undelivered) in its placed streams."""
        return f"{self._model(model)}:placed-requests"

    def worker_load(self, model: str) -> str:
        """Hash worker id -> the prompt tokens it holds uncomputed (its engine's
        ``num_waiting_prefill_tokens``), written in each step's publish pipeline when it
        changed: placement's load, fresher than the heartbeat's."""
        return f"{self._model(model)}:load"

    def worker_held(self, model: str) -> str:
        """Hash worker id -> the requests it holds (its engine's running + waiting),
        written by its pull script together with the entries it takes (so a pulled
        request leaves the placed-requests count and joins this one at once), and when
        it changed without a pull: placement's count of the requests that wait for or
        hold a decode slot there."""
        return f"{self._model(model)}:held"

    def kv_index(self, model: str, worker_id: str) -> str:
        """Set of the block hashes (``shared/block_hashes.py``, 16 bytes each) that worker
        ``worker_id`` holds in its prefix cache, as its KV events say, plus those of
        prompts placed on it that it has not computed yet."""
        return f"{self._model(model)}:kv:{worker_id}"

    def arrivals_channel(self, model: str) -> str:
        """Pub/sub channel on which the enqueue script announces each request of ``model``
        queued in a class above the lowest: ``<class rank>:<tenant>``, as text."""
        return f"{self._model(model)}:arrivals"

    def gateway_channel(self, gateway_id: str) -> str:
        """Pub/sub channel on which one gateway receives token and error messages."""
        return f"{self.namespace}:gateway:{gateway_id}"

    def control_channel(self) -> str:
        """Pub/sub channel of control messages (aborts) for all workers."""
        return f"{self.namespace}:control"

    def worker_key(self, worker_id: str) -> str:
        """Heartbeat key of one worker; its value is an encoded ``WorkerStatus``."""
        return f"{self.namespace}:worker:{worker_id}"

    def request_id_key(self, model: str, tenant: str, request_id: str) -> str:
        """Marks a client-supplied request id of key tenant ``tenant`` as in flight at
        ``model`` (value: the request's wire id) until the request ends, at most for the
        request's timeout: the same id does not run twice at once for one tenant and
        model, and tenants' ids never meet (``gateway/request_ids.py``). In the model's
        hash slot, as the enqueue script sets it. ``tenant`` holds no ``:`` (16 hex
        characters or ``anonymous``), so the part after it is the id."""
        return f"{self._model(model)}:request-id:{tenant}:{request_id}"

    def server_secret(self) -> str:
        """The deployment's random secret, set once with SET NX (``shared/server_secret.py``)."""
        return f"{self.namespace}:server-secret"

    def rate_limit_key(self, model: str, tenant: str) -> str:
        """Token buckets of one tenant for ``model`` (fields ``r``, ``t``: requests and
        tokens left; ``ms``: Redis time of the last update). Expires when both buckets are
        full again, which is what a missing key means (``gateway/rate_limits.py``)."""
        return f"{self._model(model)}:rate-limit:{tenant}"

    def worker_pattern(self) -> str:
        """SCAN pattern that matches every worker heartbeat key."""
        return f"{self.namespace}:worker:*"

    def file_key(self, file_id: str) -> str:
        """Metadata of one uploaded or output file: an OpenAI file object as JSON."""
        return f"{self.namespace}:file:{file_id}"

    def files_index(self) -> str:
        """Sorted set of every file id, scored by creation time (unix seconds, fractional)."""
        return f"{self.namespace}:files"

    def owner_files(self, owner: str) -> str:
        """Sorted set of the file ids of owner ``owner`` (a key tenant), scored by creation time."""
        return f"{self.namespace}:files:owner:{owner}"

    def response_key(self, response_id: str) -> str:
        """A stored Responses API response (``gateway/response_store.py``): one key per
        response, of no model, so a Redis Cluster serves it too (one command per key)."""
        return f"{self.namespace}:response:{response_id}"

    def batch_key(self, batch_id: str) -> str:
        """Hash of one batch's object fields, each value JSON (``shared/batch_store.py``)."""
        return f"{self.namespace}:batch:{batch_id}"

    def batches_index(self) -> str:
        """Sorted set of every batch id, scored by creation time (unix seconds, fractional)."""
        return f"{self.namespace}:batches"

    def owner_batches(self, owner: str) -> str:
        """Sorted set of the batch ids of owner ``owner`` (a key tenant), scored by creation time."""
        return f"{self.namespace}:batches:owner:{owner}"

    def active_batches(self) -> str:
        """Set of the batch ids not yet in a final status (the batch worker resumes them)."""
        return f"{self.namespace}:batches:active"

    def batch_results(self, batch_id: str) -> str:
        """Hash custom_id -> result line (JSON) of one batch: written once per line (HSETNX)."""
        return f"{self.namespace}:batch:{batch_id}:results"

    def batch_lease(self, batch_id: str) -> str:
        """Lease of the batch worker running ``batch_id`` (value: its token; TTL ``batch_lease_s``)."""
        return f"{self.namespace}:batch:{batch_id}:lease"

    def batch_resumed(self, batch_id: str) -> str:
        """Set (with a TTL of a few resume intervals) when ``resume_batches`` enqueues a job
        for ``batch_id``, so a batch waiting for a free job slot gets one job, not one per tick."""
        return f"{self.namespace}:batch:{batch_id}:resumed"

    def arq_queue(self) -> str:
        """arq's job queue of batch jobs (its other keys live under arq's own ``arq:`` prefix)."""
        return f"{self.namespace}:arq:queue"
