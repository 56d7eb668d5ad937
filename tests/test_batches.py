"""The Batch API end to end: the official ``openai`` client against a gateway, a sim
worker and an ``inferq batch-worker`` (arq) on a real Redis: upload, validation, a batch
to ``completed``, cancel, expiry, an input file deleted mid-batch, and a batch worker
killed mid-batch. Tenants and ownership: tests/test_tenants.py."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from shared.keys import Keys
from tests import processes

MODEL = "SmolLM2-135M-Instruct"
FINAL = ("completed", "failed", "expired", "cancelled")
#: Sim step time, ms: a line of N tokens takes about N steps.
SIM_STEP_MS = 5
BATCH_CONCURRENCY = 8
BATCH_URL = "/v1/chat/completions"


def _lines(n: int, max_tokens: int, prefix: str = "req") -> bytes:
    return "".join(json.dumps({
        "custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": f"line {i}"}]},
    }) + "\n" for i in range(n)).encode()



def wait_for_batch(client: Any, batch_worker: Any, log_path: Path, batch_id: str, until: tuple[str, ...],
                   min_done: int | None, timeout_s: float) -> Any:
    """Poll batch ``batch_id`` through the openai ``client`` until its status is in
    ``until`` (or, with ``min_done``, until that many lines have a result), while the
    ``batch_worker`` process lives (else fail with the end of its log at ``log_path``).

    Raises:
        TimeoutError: not there after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        counts = batch.request_counts
        done = counts.completed + counts.failed if counts else 0
        if batch.status in until or (min_done is not None and done >= min_done):
            return batch
        assert batch_worker.poll() is None, log_path.read_text()[-3000:]
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id} still {batch.status} ({batch.request_counts})")

class Stack:
    """Redis + sim worker + gateway + batch worker, started once for the module."""

    def __init__(self, tmp: Path) -> None:
        from shared.embedded_redis import EmbeddedRedis

        self.tmp = tmp
        self.files_dir = tmp / "files"
        self.redis = EmbeddedRedis().start()
        self.port = processes.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker = processes.start("worker", self.redis.url, "--backend", "sim", "--sim-step-time-ms",
                                      str(SIM_STEP_MS), log_path=tmp / "worker.log")
        self.gateway = self.start_gateway()
        self.batch_worker = self.start_batch_worker()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def start_gateway(self) -> Any:
        return processes.start("gateway", self.redis.url, "--port", str(self.port),
                               "--files-dir", str(self.files_dir), log_path=self.tmp / "gateway.log")

    def start_batch_worker(self) -> Any:
        return processes.start("batch-worker", self.redis.url, "--files-dir", str(self.files_dir),
                               "--batch-gateway-url", self.url, "--batch-concurrency", str(BATCH_CONCURRENCY),
                               "--batch-lease-s", "1.5", "--batch-resume-interval-s", "1",
                               log_path=self.tmp / "batch-worker.log")

    def close(self) -> None:
        for proc in (self.batch_worker, self.gateway, self.worker):
            processes.stop(proc)
        self.client.close()
        self.redis.close()

    def create(self, data: bytes) -> Any:
        file = self.client.files.create(file=("in.jsonl", data), purpose="batch")
        return self.client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                          completion_window="24h", metadata={"test": "yes"})

    def wait(self, batch_id: str, until: tuple[str, ...], timeout_s: float = 60.0,
             min_done: int | None = None) -> Any:
        """Poll the batch until its status is in ``until`` (or, with ``min_done``, until
        that many lines have a result)."""
        return wait_for_batch(self.client, self.batch_worker, self.tmp / "batch-worker.log", batch_id, until,
                              min_done, timeout_s)

    def num_finished(self) -> float:
        """Requests the gateway has finished so far (``inferq:request_success``, all reasons)."""
        text = httpx.get(self.url + "/metrics", timeout=5, trust_env=False).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("inferq:request_success_total"))

    def read(self, file_id: str | None) -> list[dict[str, Any]]:
        if file_id is None:
            return []
        return [json.loads(line) for line in self.client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm_source) -> Iterator[Stack]:
    s = Stack(tmp_path_factory.mktemp("batches"))
    try:
        processes.wait_for_gateway(s.url, s.gateway)
        processes.wait_for_workers(s.redis.url, 1, [s.worker])
        yield s
    finally:
        s.close()


def _check_one_per_custom_id(lines: list[dict[str, Any]], expected: set[str]) -> None:
    ids = [line["custom_id"] for line in lines]
    assert len(ids) == len(set(ids)), "a custom_id appears twice"
    assert set(ids) == expected


def _run_to_completion(stack: Stack, num_lines: int) -> None:
    batch = stack.create(_lines(num_lines, max_tokens=2))
    assert batch.status == "validating" and batch.metadata == {"test": "yes"}
    done = stack.wait(batch.id, FINAL)
    assert done.status == "completed", done
    assert done.request_counts.total == num_lines and done.request_counts.completed == num_lines
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    output = stack.read(done.output_file_id)
    _check_one_per_custom_id(output, {f"req-{i}" for i in range(num_lines)})
    for line in output:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert line["response"]["body"]["object"] == "chat.completion"
    assert batch.id in [b.id for b in stack.client.batches.list(limit=100).data]


def test_openai_client_runs_a_batch_to_completion(stack):
    _run_to_completion(stack, 200)


@pytest.mark.slow
def test_openai_client_runs_a_1000_line_batch(stack):
    _run_to_completion(stack, 1000)


def test_files_crud_and_invalid_lines(stack):
    client = stack.client
    good = client.files.create(file=("ok.jsonl", _lines(3, 2)), purpose="batch")
    assert good.purpose == "batch" and good.bytes == len(_lines(3, 2)) and good.filename == "ok.jsonl"
    assert client.files.retrieve(good.id).id == good.id
    assert good.id in [f.id for f in client.files.list().data]
    assert client.files.content(good.id).content == _lines(3, 2)
    assert client.files.delete(good.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(good.id)

    bad = (_lines(1, 2)
           + b"not json\n"
           + json.dumps({"custom_id": "req-0", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": MODEL}}).encode() + b"\n"
           + json.dumps({"custom_id": "x", "method": "GET", "url": "/v1/chat/completions",
                         "body": {"model": MODEL}}).encode() + b"\n"
           + json.dumps({"custom_id": "y", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": MODEL}}).encode() + b"\n"
           + json.dumps({"custom_id": "z", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "other"}}).encode() + b"\n")
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("bad.jsonl", bad), purpose="batch")
    message = str(info.value)
    assert "line 1:" not in message
    for fragment in ("line 2: not valid JSON", "line 3: duplicate `custom_id`", "line 4: `method`",
                     "line 5: `url`", "line 6: `body.model`"):
        assert fragment in message, message
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("ok.jsonl", _lines(1, 2)), purpose="fine-tune")  # type: ignore[arg-type]


def test_bad_batches(stack):
    client = stack.client
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h")
    file = client.files.create(file=("in.jsonl", _lines(2, 2)), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                              completion_window="1h")  # type: ignore[arg-type]
    # The lines are chat requests; the batch says completions: it fails, naming the lines.
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    done = stack.wait(batch.id, FINAL)
    assert done.status == "failed" and done.failed_at, done
    assert [e.line for e in done.errors.data] == [1, 2]
    with pytest.raises(openai.APIStatusError) as info:
        client.batches.cancel(batch.id)
    assert info.value.status_code == 409


def test_cancel_stops_sending_and_finalizes(stack):
    num_lines = 100
    batch = stack.create(_lines(num_lines, max_tokens=100))  # ~0.5 s a line, 8 at a time
    stack.wait(batch.id, (), min_done=BATCH_CONCURRENCY)
    cancelling = stack.client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = stack.wait(batch.id, FINAL)
    assert done.status == "cancelled", done
    counts = done.request_counts
    assert done.cancelled_at and counts.completed + counts.failed < num_lines
    output = stack.read(done.output_file_id)
    assert len(output) == counts.completed and len({line["custom_id"] for line in output}) == len(output)
    time.sleep(1.0)  # nothing more runs once cancelled
    assert stack.client.batches.retrieve(batch.id).request_counts == counts


def test_expiry_sends_the_rest_to_the_error_file(stack):
    num_lines = 100
    batch = stack.create(_lines(num_lines, max_tokens=100))
    stack.wait(batch.id, (), min_done=BATCH_CONCURRENCY)
    # The completion window runs out now.
    r = redis.from_url(stack.redis.url)
    r.hset(Keys().batch_key(batch.id), "expires_at", json.dumps(int(time.time()) - 1))
    r.close()
    done = stack.wait(batch.id, FINAL)
    assert done.status == "expired", done
    assert done.expired_at
    output, errors = stack.read(done.output_file_id), stack.read(done.error_file_id)
    _check_one_per_custom_id(output + errors, {f"req-{i}" for i in range(num_lines)})
    assert output and errors
    assert all(e["error"]["code"] == "batch_expired" and e["response"] is None for e in errors)
    assert done.request_counts.failed == len(errors) and done.request_counts.completed == len(output)


def test_input_deleted_mid_batch_fails_the_batch(stack):
    """The input file deleted while the batch runs: it stops sending and ends ``failed``
    with ``file_not_found``, its results so far in its files; nothing retries."""
    num_lines = 100
    batch = stack.create(_lines(num_lines, max_tokens=100, prefix="gone"))
    stack.wait(batch.id, (), min_done=BATCH_CONCURRENCY)
    assert stack.client.files.delete(batch.input_file_id).deleted
    done = stack.wait(batch.id, FINAL, timeout_s=20)
    assert done.status == "failed" and done.failed_at, done
    assert [(e.code, e.param) for e in done.errors.data] == [("file_not_found", "input_file_id")]
    counts = done.request_counts
    assert BATCH_CONCURRENCY <= counts.completed < num_lines
    output = stack.read(done.output_file_id)
    assert len(output) == counts.completed and all(line["custom_id"].startswith("gone-") for line in output)
    time.sleep(1.5)  # a resume tick: the batch stays failed and nothing is logged again
    assert stack.client.batches.retrieve(batch.id).status == "failed"
    assert "FileNotFoundError" not in (stack.tmp / "batch-worker.log").read_text()


def test_input_deleted_while_cancelling_ends_cancelled(stack):
    batch = stack.create(_lines(100, max_tokens=100, prefix="gone-c"))
    stack.wait(batch.id, (), min_done=BATCH_CONCURRENCY)
    assert stack.client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    stack.client.files.delete(batch.input_file_id)
    done = stack.wait(batch.id, FINAL, timeout_s=20)
    assert done.status == "cancelled" and done.cancelled_at, done
    assert "FileNotFoundError" not in (stack.tmp / "batch-worker.log").read_text()


@pytest.mark.parametrize(("status", "final"), [("finalizing", "failed"), ("in_progress", "failed"),
                                               ("cancelling", "cancelled")])
async def test_a_runner_ends_a_batch_whose_input_is_gone(tmp_path, status, final):
    """Whatever status a batch had reached, a runner that finds its input file gone ends
    it at once (before: ``finalizing`` forever, FileNotFoundError every resume); the
    results recorded so far go to the owner's files."""
    import redis.asyncio as aioredis

    from shared.batch_store import BatchStore
    from shared.embedded_redis import EmbeddedRedis
    from shared.settings import BatchSettings
    from worker.batch_jobs import BatchRunner

    server = EmbeddedRedis().start()
    client = aioredis.from_url(server.url)
    try:
        store = BatchStore(client, Keys(), str(tmp_path))
        now = int(time.time())
        await store.create_batch({"id": "batch_0123", "object": "batch", "status": status, "created_at": now,
                                  "expires_at": now + 3600, "input_file_id": "file-gone", "endpoint": BATCH_URL,
                                  "total": 2, "completed": 0, "failed": 0}, owner="owner-a")
        result = {"id": "r", "custom_id": "b", "response": {"status_code": 200, "body": {}}, "error": None}
        await store.record("batch_0123", "b", result, ok=True)
        await store.record("batch_0123", "a", {**result, "custom_id": "a"}, ok=True)
        async with httpx.AsyncClient() as http:
            assert await BatchRunner(store, BatchSettings(files_dir=str(tmp_path)), http).run("batch_0123") == final
        stored = await store.get_batch("batch_0123")
        assert stored is not None and stored.obj["status"] == final and stored.obj[f"{final}_at"]
        if final == "failed":
            assert stored.obj["errors"]["data"][0]["code"] == "file_not_found"
        assert await store.active_ids() == []  # no resume picks it up again
        output = await store.get_file(stored.obj["output_file_id"])
        assert output is not None and output.owner == "owner-a"
        assert [json.loads(line)["custom_id"] for line in store.path(output.obj["id"]).read_text().splitlines()] == [
            "a", "b"]
    finally:
        await client.aclose()
        server.close()


def test_killed_batch_worker_and_gateway_lose_no_line_and_run_none_twice(stack):
    """SIGKILL the batch worker and the gateway mid-batch, start both again: the new
    runner waits for the old one's lease to lapse, tries lines again until the gateway
    answers, skips the lines that have a result, and sends again only those that were
    in flight."""
    num_lines = 150
    finished_before = stack.num_finished()
    batch = stack.create(_lines(num_lines, max_tokens=20, prefix="kill"))
    stack.wait(batch.id, (), min_done=30)
    finished_old_gateway = stack.num_finished() - finished_before
    for proc in (stack.batch_worker, stack.gateway):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    r = redis.from_url(stack.redis.url)
    num_done = r.hlen(Keys().batch_results(batch.id))
    r.close()
    assert num_done < num_lines, "the batch finished before the kill"
    stack.batch_worker = stack.start_batch_worker()  # before the gateway is up: it tries again
    stack.gateway = stack.start_gateway()
    processes.wait_for_gateway(stack.url, stack.gateway)
    done = stack.wait(batch.id, FINAL, timeout_s=30)
    assert done.status == "completed", done
    assert done.request_counts.completed == num_lines and done.request_counts.failed == 0
    _check_one_per_custom_id(stack.read(done.output_file_id), {f"kill-{i}" for i in range(num_lines)})
    # Only the lines in flight at the kill may run twice (at-least-once), not the done ones.
    # (The old gateway's count was read a moment before the kill: it can only be low.)
    assert finished_old_gateway + stack.num_finished() <= num_lines + BATCH_CONCURRENCY


def test_line_limit(tmp_path):
    from gateway.files import validate_lines

    path = tmp_path / "in.jsonl"
    path.write_bytes(_lines(3, 2))
    assert validate_lines(path, MODEL, max_lines=3) == (3, [])
    _, errors = validate_lines(path, MODEL, max_lines=2)
    assert errors == ["the file has more than 2 lines (the most a batch takes)"]


async def test_upload_streams_to_disk_and_stops_at_the_size_limit(tmp_path):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from gateway.errors import install_error_handlers
    from gateway.files import receive_upload

    app = FastAPI()
    install_error_handlers(app)

    async def upload(request):  # a plain Starlette route: the test module's annotations are strings
        fields, filename = await receive_upload(request, tmp_path / "out", max_file_bytes=100)
        return JSONResponse({"fields": fields, "filename": filename})

    app.router.add_route("/upload", upload, methods=["POST"])

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        ok = await client.post("/upload", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"x" * 100)})
        assert ok.json() == {"fields": {"purpose": "batch"}, "filename": "a.jsonl"}
        assert (tmp_path / "out").read_bytes() == b"x" * 100
        big = await client.post("/upload", data={"purpose": "batch"}, files={"file": ("a.jsonl", b"x" * 101)})
        assert big.status_code == 413 and "100 bytes" in big.json()["error"]["message"]
        not_form = await client.post("/upload", json={"purpose": "batch"})
        assert not_form.status_code == 400
