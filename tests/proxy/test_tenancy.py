"""Tenancy on the Batch API: files, batches and their results belong to the key (or tenant) that made them;
any other key gets the 404 a missing id gets. The official openai client against the proxy under uvicorn
and a real vLLM CPU server; a database from before owners; keys compared in constant time; /metrics and
/health behind protect_metrics."""

import asyncio
import hashlib
import os
import sqlite3
import subprocess
import sys

import httpx
import openai
import pytest

import moe_cohort.send.auth
from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.proxy.app import create_app
from moe_cohort.send.auth import Authorizer
from moe_cohort.send.errors import Unauthorized
from moe_cohort.send.settings import Settings, SettingsError
from tests.helpers.batch_api import jsonl, request_line, settings, wait_for
from tests.helpers.proxy_thread import ProxyThread

ALICE, BOB = "sk-alice-7f3c9a", "sk-bob-12d4e8"


def as_key(proxy, key):
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)


def not_found(call, *args, **kw):
    with pytest.raises(openai.NotFoundError) as error:
        call(*args, **kw)
    return error.value.body


def test_a_key_cannot_see_or_touch_another_keys_files_and_batches(vllm_server, tmp_path):
    keyed = settings(vllm_server, tmp_path, api_keys=(ALICE, BOB))
    with ProxyThread(keyed) as proxy:
        alice, bob = as_key(proxy, ALICE), as_key(proxy, BOB)
        upload = alice.files.create(file=("mine.jsonl", jsonl([request_line("a", "alice's prompt", max_tokens=2),
                                                               request_line("b", "x", max_tokens=5000)])),
                                    purpose="batch")
        batch = wait_for(alice, alice.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                                     completion_window="24h").id)
        assert batch.status == "completed" and batch.output_file_id and batch.error_file_id
        alices = {upload.id, batch.output_file_id, batch.error_file_id}
        bobs = bob.files.create(file=("bob.jsonl", jsonl([request_line("c", "bob's")])), purpose="batch")

        assert {f.id for f in bob.files.list()} == {bobs.id}
        assert {f.id for f in bob.files.list(purpose="batch_output")} == set()
        assert [b.id for b in bob.batches.list()] == []
        missing = not_found(bob.files.retrieve, "file-nosuchfile")
        for file_id in alices:
            assert not_found(bob.files.retrieve, file_id)["message"] == missing["message"].replace("file-nosuchfile",
                                                                                                  file_id)
            not_found(bob.files.content, file_id)
            not_found(bob.files.delete, file_id)
        not_found(bob.batches.retrieve, batch.id)
        not_found(bob.batches.cancel, batch.id)
        refused = not_found(bob.batches.create, input_file_id=upload.id, endpoint="/v1/chat/completions",
                            completion_window="24h")
        assert refused["param"] == "input_file_id"

        assert alices <= {f.id for f in alice.files.list()} and bobs.id not in {f.id for f in alice.files.list()}
        assert b"alice's prompt" in alice.files.content(upload.id).content
        assert [b.id for b in alice.batches.list()] == [batch.id]
        not_found(alice.files.retrieve, bobs.id)

    with ProxyThread(keyed.replace(port=free_port())) as proxy:
        alice, bob = as_key(proxy, ALICE), as_key(proxy, BOB)  # a restart on the same data dir
        assert {f.id for f in bob.files.list()} == {bobs.id}
        not_found(bob.batches.retrieve, batch.id)
        not_found(bob.files.content, batch.output_file_id)
        assert alice.batches.retrieve(batch.id).status == "completed"
        assert alice.files.delete(upload.id).deleted
        not_found(alice.files.retrieve, upload.id)

    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert ALICE.encode() not in stored and BOB.encode() not in stored
    with sqlite3.connect(tmp_path / "cohort.sqlite3") as db:
        owners = {row[0] for row in db.execute("SELECT owner FROM files UNION SELECT owner FROM batches")}
    assert owners == {"key:" + hashlib.sha256(k.encode()).hexdigest() for k in (ALICE, BOB)}


def call(app, *requests):
    """Answers of the app (in process, as the ASGI server calls it) to (method, path, headers) requests."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as c:
            return [await c.request(method, path, headers=headers, **kw) for method, path, headers, *more in requests
                    for kw in [more[0] if more else {}]]

    return asyncio.run(main())


def bearer(key):
    return {"authorization": f"Bearer {key}"}


def upload(key):
    return ("POST", "/v1/files", bearer(key), {"files": {"file": ("a.jsonl", b"{}\n")}, "data": {"purpose": "batch"}})


def test_keys_of_one_tenant_share_its_files(tmp_path):
    app = create_app(Settings(backends=("http://127.0.0.1:9",), encoder="none", data_dir=str(tmp_path),
                              api_keys=("k-old=team-a", "k-new=team-a", "k-other")))
    (made,) = call(app, upload("k-old"))
    new, other = call(app, ("GET", f"/v1/files/{made.json()['id']}", bearer("k-new")),
                      ("GET", f"/v1/files/{made.json()['id']}", bearer("k-other")))
    assert new.status_code == 200 and other.status_code == 404
    with sqlite3.connect(tmp_path / "cohort.sqlite3") as db:
        assert db.execute("SELECT owner FROM files").fetchall() == [("tenant:team-a",)]


def test_records_from_before_owners_belong_to_the_open_proxy(tmp_path):
    with sqlite3.connect(tmp_path / "cohort.sqlite3") as db:  # the schema before owners, with one upload
        db.execute("CREATE TABLE files (id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, "
                   "bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, path TEXT NOT NULL)")
        db.execute("CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, "
                   "status TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, "
                   "completion_window TEXT NOT NULL, created_at INTEGER NOT NULL, expires_at INTEGER, "
                   "in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, "
                   "cancelling_at INTEGER, cancelled_at INTEGER, expired_at INTEGER, output_file_id TEXT, "
                   "error_file_id TEXT, total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, "
                   "failed INTEGER NOT NULL DEFAULT 0, errors TEXT, metadata TEXT, usage TEXT, input_sha256 TEXT, "
                   "input_bytes INTEGER)")
        db.execute("INSERT INTO files VALUES ('file-old', 'old.jsonl', 'batch', 3, 0, ?)", (str(tmp_path / "old"),))
    (tmp_path / "files").mkdir()
    (tmp_path / "old").write_bytes(b"{}\n")
    base = Settings(backends=("http://127.0.0.1:9",), encoder="none", data_dir=str(tmp_path))
    (keyed,) = call(create_app(base.replace(api_keys=("k",))), ("GET", "/v1/files/file-old", bearer("k")))
    (open_,) = call(create_app(base), ("GET", "/v1/files", {}))
    assert keyed.status_code == 404
    assert [f["id"] for f in open_.json()["data"]] == ["file-old"]


def test_every_key_is_compared_in_constant_time(monkeypatch):
    compared = []

    def counting(a, b):
        compared.append((len(a), len(b)))
        return real(a, b)

    real = moe_cohort.send.auth.hmac.compare_digest
    monkeypatch.setattr(moe_cohort.send.auth.hmac, "compare_digest", counting)
    authorize = Authorizer(("first", "second=team", "third"))
    assert authorize(bearer("first")) == "key:" + hashlib.sha256(b"first").hexdigest()
    assert authorize(bearer("second")) == "tenant:team"
    with pytest.raises(Unauthorized):
        authorize(bearer("fourth-and-much-longer"))
    assert len(compared) == 9  # every configured key, every time, whichever matched
    assert len({lengths for lengths in compared}) == 1  # digests: the key's length shapes nothing
    assert Authorizer(())(bearer("anything")) == Authorizer(())({}) == ""


@pytest.mark.parametrize("keys, message", [(("",), "empty"), (("k=a", "k=b"), "two tenants"),
                                           (("=team",), "empty")])
def test_bad_key_lists_are_refused_at_start_up(keys, message):
    with pytest.raises(SettingsError, match=message):
        Settings(api_keys=keys)


def test_protect_metrics_needs_a_key_for_metrics_and_hides_the_backend_from_health(tmp_path):
    base = Settings(backends=("http://127.0.0.1:9",), encoder="none", data_dir=str(tmp_path), api_keys=("k",))
    open_metrics, open_health = call(create_app(base), ("GET", "/metrics", {}), ("GET", "/health", {}))
    assert open_metrics.status_code == 200 and "cohort_requests" in open_metrics.text
    assert open_health.json()["replicas"][0]["backend"] == "http://127.0.0.1:9"
    no_key, wrong_key, with_key, health, health_with_key = call(
        create_app(base.replace(protect_metrics=True)), ("GET", "/metrics", {}), ("GET", "/metrics", bearer("x")),
        ("GET", "/metrics", bearer("k")), ("GET", "/health", {}), ("GET", "/health", bearer("k")))
    assert no_key.status_code == wrong_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert with_key.status_code == 200 and "cohort_requests" in with_key.text
    assert health.status_code == 503 and health.json() == {"status": "backend unavailable"}
    assert health_with_key.json()["replicas"][0]["backend"] == "http://127.0.0.1:9"
    with pytest.raises(SettingsError, match="protect_metrics"):
        Settings(protect_metrics=True)


def test_unauthenticated_paths_do_not_reach_the_metrics(tmp_path):
    app = create_app(Settings(backends=("http://127.0.0.1:9",), encoder="none", data_dir=str(tmp_path), api_keys=("k",)))
    *_, metrics = call(app, *[("GET", f"/v1/files/file-secret{i}", {}) for i in range(3)], ("GET", "/metrics", {}))
    assert "file-secret" not in metrics.text


@pytest.mark.integration
@pytest.mark.parametrize("flags, env, message", [
    ([], {"COHORT_PROTECT_METRICS": "1"}, "protect_metrics (env COHORT_PROTECT_METRICS) needs at least one --api-key"),
    (["--api-key", "k=team-a", "--api-key", "k=team-b"], {}, "gives one key for two tenants"),
])
def test_serve_refuses_bad_security_settings_in_one_line(flags, env, message):
    done = subprocess.run([sys.executable, "-m", "moe_cohort.cli", "serve", "--backend", "http://127.0.0.1:9",
                           "--encoder", "none", *flags], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 2 and message in said and len(said.splitlines()) == 1, said
