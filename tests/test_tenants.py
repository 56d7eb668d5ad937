"""Tenants kept apart, end to end (docs/operations.md, "Tenants and isolation"): two
gateway processes on one Redis with keys k1, k2, k3 and an admin key, a sim worker and
a batch worker; the official ``openai`` client.

Every files and batches route answers another tenant's object with the 404 of a missing
one, on either gateway, while its owner and the admin key see it; a batch's output files
are its owner's; a batch's lines run as its owner's tenant, under its owner's rate limit
(k3: 3 requests a minute), in the batch class."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.tenants import tenant_id
from shared.keys import Keys
from shared.server_secret import tenant_key
from tests import processes
from tests.test_batches import FINAL, MODEL, SIM_STEP_MS, _lines, wait_for_batch

pytestmark = pytest.mark.timeout(180)

KEYS = ("k1", "k2", "k3")
ADMIN = "adm"
#: k3's limit, requests per minute: a batch of k3 may not run more lines than this at once.
K3_RPM = 3
BATCH_CONCURRENCY = 8


class Stack:
    """Redis, a sim worker, two gateways and a batch worker (sending to gateway 0)."""

    def __init__(self, tmp: Path) -> None:
        from shared.embedded_redis import EmbeddedRedis

        self.tmp = tmp
        self.redis = EmbeddedRedis().start()
        self.worker = processes.start("worker", self.redis.url, "--backend", "sim", "--sim-step-time-ms",
                                      str(SIM_STEP_MS), log_path=tmp / "worker.log")
        self.urls: list[str] = []
        self.gateways = []
        auth = [a for k in KEYS for a in ("--api-key", k)] + ["--admin-api-key", ADMIN,
                                                               "--rate-limits", f"k3={K3_RPM}:0"]
        for i in range(2):
            port = processes.free_port()
            self.urls.append(f"http://127.0.0.1:{port}")
            self.gateways.append(processes.start("gateway", self.redis.url, "--port", str(port), "--files-dir",
                                                 str(tmp / "files"), *auth, log_path=tmp / f"gateway{i}.log"))
        self.batch_worker = processes.start(
            "batch-worker", self.redis.url, "--files-dir", str(tmp / "files"), "--batch-gateway-url", self.urls[0],
            "--batch-concurrency", str(BATCH_CONCURRENCY), "--batch-resume-interval-s", "1",
            log_path=tmp / "batch-worker.log")
        self.clients: dict[tuple[str, int], openai.OpenAI] = {}

    def client(self, key: str, gateway: int = 0) -> openai.OpenAI:
        if (key, gateway) not in self.clients:
            self.clients[key, gateway] = openai.OpenAI(base_url=self.urls[gateway] + "/v1", api_key=key, max_retries=0)
        return self.clients[key, gateway]

    def http(self, key: str, method: str, path: str, gateway: int = 1, **kwargs: Any) -> httpx.Response:
        return httpx.request(method, self.urls[gateway] + path, headers={"Authorization": f"Bearer {key}"},
                             timeout=30, trust_env=False, **kwargs)

    def tenant(self, key: str) -> str:
        """``key``'s tenant id, from the deployment's secret in Redis."""
        client = redis.from_url(self.redis.url)
        try:
            secret = client.get(Keys().server_secret())
        finally:
            client.close()
        assert secret is not None, "no gateway has made the server secret yet"
        return tenant_id(tenant_key(secret, ""), key)

    def upload(self, key: str, data: bytes) -> Any:
        return self.client(key).files.create(file=("in.jsonl", data), purpose="batch")

    def create(self, key: str, data: bytes) -> Any:
        file = self.upload(key, data)
        return self.client(key).batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                               completion_window="24h")

    def wait(self, batch_id: str, until: tuple[str, ...], min_done: int | None = None, timeout_s: float = 60.0,
             key: str = "k1") -> Any:
        return wait_for_batch(self.client(key), self.batch_worker, self.tmp / "batch-worker.log", batch_id, until,
                              min_done, timeout_s)

    def close(self) -> None:
        for proc in (self.batch_worker, *self.gateways, self.worker):
            processes.stop(proc)
        for client in self.clients.values():
            client.close()
        self.redis.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_source) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("tenants"))
    try:
        for url, proc in zip(s.urls, s.gateways, strict=True):
            processes.wait_for_gateway(url, proc)
        processes.wait_for_workers(s.redis.url, 1, [s.worker])
        yield s
    finally:
        s.close()


def assert_missing(stack: Stack, r: httpx.Response, path: str, object_id: str) -> None:
    """``r`` is the 404 that ``path`` (with ``{id}``) answers for an id that does not exist,
    word for word: it tells nothing of whether ``object_id`` exists."""
    prefix = object_id.split("-")[0].split("_")[0]
    unknown = f"{prefix}{'-' if prefix == 'file' else '_'}{'0' * 24}"
    method = "POST" if path.endswith("/cancel") else "DELETE" if path.startswith("DELETE ") else "GET"
    missing = stack.http("k2", method, path.removeprefix("DELETE ").format(id=unknown))
    assert missing.status_code == 404, missing.text
    assert r.status_code == 404, r.text
    assert r.json() == json.loads(missing.text.replace(unknown, object_id)), (r.text, missing.text)


# -- files ---------------------------------------------------------------------------------

def test_list_files_shows_each_key_its_own(stack):
    mine = stack.upload("k1", _lines(2, 2, prefix="list"))
    theirs = stack.upload("k2", _lines(2, 2, prefix="list"))
    assert mine.id in {f.id for f in stack.client("k1", 1).files.list().data}
    seen_by_k2 = {f.id for f in stack.client("k2", 1).files.list().data}
    assert theirs.id in seen_by_k2 and mine.id not in seen_by_k2
    assert {mine.id, theirs.id} <= {f.id for f in stack.client(ADMIN, 1).files.list().data}


def test_retrieve_file_is_404_to_another_key(stack):
    file = stack.upload("k1", _lines(2, 2))
    with pytest.raises(openai.NotFoundError):
        stack.client("k2", 1).files.retrieve(file.id)
    assert_missing(stack, stack.http("k2", "GET", f"/v1/files/{file.id}"), "/v1/files/{id}", file.id)
    assert stack.client("k1", 1).files.retrieve(file.id).id == file.id
    assert stack.client(ADMIN, 1).files.retrieve(file.id).id == file.id


def test_file_content_is_404_to_another_key(stack):
    data = _lines(2, 2, prefix="secret")
    file = stack.upload("k1", data)
    with pytest.raises(openai.NotFoundError):
        stack.client("k2", 1).files.content(file.id)
    assert_missing(stack, stack.http("k2", "GET", f"/v1/files/{file.id}/content"), "/v1/files/{id}/content",
                   file.id)
    assert stack.client("k1", 1).files.content(file.id).content == data
    assert stack.client(ADMIN, 1).files.content(file.id).content == data


def test_delete_file_is_404_to_another_key(stack):
    file = stack.upload("k1", _lines(2, 2))
    with pytest.raises(openai.NotFoundError):
        stack.client("k2", 1).files.delete(file.id)
    assert_missing(stack, stack.http("k2", "DELETE", f"/v1/files/{file.id}"), "DELETE /v1/files/{id}", file.id)
    assert stack.client("k1", 1).files.content(file.id).content == _lines(2, 2)  # still there
    assert stack.client(ADMIN, 1).files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        stack.client("k1").files.retrieve(file.id)
    own = stack.upload("k1", _lines(2, 2))
    assert stack.client("k1", 1).files.delete(own.id).deleted


# -- batches -------------------------------------------------------------------------------

def test_create_batch_from_another_keys_file_is_404(stack):
    file = stack.upload("k1", _lines(2, 2))
    num_batches = len(stack.client(ADMIN).batches.list(limit=100).data)
    with pytest.raises(openai.NotFoundError) as info:
        stack.client("k2", 1).batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                             completion_window="24h")
    error = info.value.body
    assert error["code"] == "file_not_found" and error["param"] == "input_file_id", error
    assert error["message"] == f"No such File object: {file.id}"
    assert len(stack.client(ADMIN).batches.list(limit=100).data) == num_batches  # nothing made
    batch = stack.client("k1", 1).batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h")
    assert stack.wait(batch.id, FINAL).status == "completed"


def test_retrieve_batch_is_404_to_another_key(stack):
    batch = stack.create("k1", _lines(2, 2))
    with pytest.raises(openai.NotFoundError):
        stack.client("k2", 1).batches.retrieve(batch.id)
    assert_missing(stack, stack.http("k2", "GET", f"/v1/batches/{batch.id}"), "/v1/batches/{id}", batch.id)
    assert stack.client("k1", 1).batches.retrieve(batch.id).id == batch.id
    assert stack.client(ADMIN, 1).batches.retrieve(batch.id).id == batch.id


def test_cancel_batch_is_404_to_another_key(stack):
    batch = stack.create("k1", _lines(60, max_tokens=100, prefix="cancel"))  # ~0.5 s a line, 8 at a time
    with pytest.raises(openai.NotFoundError):
        stack.client("k2", 1).batches.cancel(batch.id)
    assert_missing(stack, stack.http("k2", "POST", f"/v1/batches/{batch.id}/cancel"), "/v1/batches/{id}/cancel",
                   batch.id)
    assert stack.client("k1").batches.retrieve(batch.id).status in ("validating", "in_progress")
    assert stack.client(ADMIN, 1).batches.cancel(batch.id).status in ("cancelling", "cancelled")
    assert stack.wait(batch.id, FINAL).status == "cancelled"
    own = stack.create("k1", _lines(60, max_tokens=100, prefix="cancel"))
    assert stack.client("k1", 1).batches.cancel(own.id).status in ("cancelling", "cancelled")
    assert stack.wait(own.id, FINAL).status == "cancelled"


def test_list_batches_shows_each_key_its_own_page_by_page(stack):
    k1_ids = [stack.create("k1", _lines(1, 2)).id for _ in range(3)]
    k2_id = stack.create("k2", _lines(1, 2)).id
    k2_list = stack.client("k2", 1).batches.list(limit=100)
    assert k2_id in {b.id for b in k2_list.data} and not set(k1_ids) & {b.id for b in k2_list.data}
    # k1's newest three, two at a time: has_more and `after` walk k1's own batches only.
    first = stack.http("k1", "GET", "/v1/batches", params={"limit": 2}).json()
    assert [b["id"] for b in first["data"]] == k1_ids[:0:-1] and first["has_more"] is True
    assert first["last_id"] == k1_ids[1]
    rest = stack.http("k1", "GET", "/v1/batches", params={"limit": 100, "after": first["last_id"]}).json()
    assert rest["data"][0]["id"] == k1_ids[0] and k2_id not in {b["id"] for b in rest["data"]}
    assert rest["has_more"] is False
    last = stack.http("k1", "GET", "/v1/batches", params={"limit": 1, "after": k1_ids[1]}).json()
    assert [b["id"] for b in last["data"]] == [k1_ids[0]]
    # Another key's id as `after` is as unknown as a missing one: an empty page.
    assert stack.http("k2", "GET", "/v1/batches", params={"after": k1_ids[0]}).json()["data"] == []
    assert {*k1_ids, k2_id} <= {b.id for b in stack.client(ADMIN, 1).batches.list(limit=100).data}


def test_output_files_belong_to_the_batch_owner(stack):
    batch = stack.create("k1", _lines(3, 2, prefix="out"))
    done = stack.wait(batch.id, FINAL)
    assert done.status == "completed" and done.output_file_id
    with pytest.raises(openai.NotFoundError):
        stack.client("k2", 1).files.content(done.output_file_id)
    assert done.output_file_id not in {f.id for f in stack.client("k2", 1).files.list().data}
    lines = stack.client("k1", 1).files.content(done.output_file_id).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in lines) == ["out-0", "out-1", "out-2"]
    assert done.output_file_id in {f.id for f in stack.client("k1", 1).files.list().data}
    assert stack.client(ADMIN, 1).files.retrieve(done.output_file_id).purpose == "batch_output"


# -- a batch runs as its owner -------------------------------------------------------------

def test_a_batchs_lines_run_under_its_owners_rate_limit(stack):
    """k3 may send 3 requests a minute: its batch of 8 lines runs 3 at once and then waits
    (as its direct requests would get 429), in the batch class as k3's tenant."""
    batch = stack.create("k3", _lines(8, 2, prefix="limited"))
    stack.wait(batch.id, (), min_done=K3_RPM, key="k3")
    time.sleep(3.0)  # the other lines wait for k3's bucket (a line every 20 s)
    counts = stack.client("k3").batches.retrieve(batch.id).request_counts
    assert counts.completed == K3_RPM and counts.failed == 0, counts
    with pytest.raises(openai.RateLimitError):  # k3's own budget is what the batch spent
        stack.client("k3", 1).chat.completions.create(model=MODEL, max_tokens=2,
                                                      messages=[{"role": "user", "content": "hi"}])
    tenant = stack.tenant("k3")
    client = redis.from_url(stack.redis.url)
    try:
        assert client.exists(Keys().rate_limit_key(MODEL, tenant)) == 1  # k3's bucket, in Redis
    finally:
        client.close()
    # Admitted in the batch class as k3's tenant (what fair share and the queue metrics count by).
    metrics = httpx.get(stack.urls[0] + "/metrics", headers={"Authorization": "Bearer k1"}, timeout=10,
                        trust_env=False).text
    assert f'inferq:class_admitted_total{{model_name="{MODEL}",priority_class="batch",tenant="{tenant}"}} ' \
           f'{float(K3_RPM)}' in metrics
    stack.client("k3").batches.cancel(batch.id)
    done = stack.wait(batch.id, FINAL, key="k3")
    assert done.status == "cancelled" and done.request_counts.completed == K3_RPM
    assert done.error_file_id is None  # the waiting lines were not failed with a 429


def test_tenant_ids_are_keyed_hashes(stack):
    import hashlib

    tenant = stack.tenant("k1")
    assert tenant != hashlib.sha256(b"k1").hexdigest()[:16]
    stack.client("k1", 1).chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user",
                                                                                          "content": "hi"}])
    metrics = httpx.get(stack.urls[1] + "/metrics", headers={"Authorization": "Bearer k2"}, timeout=10,
                        trust_env=False).text
    assert f'priority_class="default",tenant="{tenant}"' in metrics
    assert hashlib.sha256(b"k1").hexdigest()[:16] not in metrics
