"""Job tokens: with API keys on, a job's events_url carries a short-lived token (``?token=``) that opens that
job's events without an Authorization header (a browser's EventSource cannot send one); a wrong token gets
403, an expired one 401, and the API key itself never appears in a URL."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from api.auth import JobTokens
from deploy.redis_server import RedisServer
from tests.api.conftest import MODEL, ScriptedWorker, ServerThread, start_api

KEY = "sk-token-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def keyed_api(redis_server: RedisServer) -> Iterator[ServerThread]:
    server = start_api(redis_server, api_keys=(KEY, "sk-other"))
    yield server
    server.stop()


def _create(api: ServerThread, headers: dict[str, str]) -> dict[str, str]:
    resp = httpx.post(api.url + "/v1/jobs", json=BODY, headers=headers, timeout=10)
    assert resp.status_code == 202, resp.text
    job: dict[str, str] = resp.json()
    return job


def _events(api: ServerThread, path: str) -> httpx.Response:
    """The events response, read to its end (the job is answered first)."""
    with httpx.stream("GET", api.url + path, timeout=10) as resp:
        resp.read()
    return resp


def _error_code(resp: httpx.Response) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


async def test_token_opens_the_events_url(keyed_api: ServerThread, redis_url: str) -> None:
    job = _create(keyed_api, AUTH)
    await ScriptedWorker(redis_url).serve()
    assert job["events_url"] == f"/v1/jobs/{job['id']}/events?token={job['token']}"
    assert KEY not in job["events_url"]
    resp = _events(keyed_api, job["events_url"])
    assert resp.status_code == 200 and '"content":"Hello"' in resp.text and "[DONE]" in resp.text
    # resume through the token too (a new EventSource can only pass Last-Event-ID in the URL)
    resumed = _events(keyed_api, job["events_url"] + "&last_event_id=3.0")
    assert resumed.status_code == 200 and "Hello" not in resumed.text and "world" not in resumed.text


def test_bad_tokens_are_refused(keyed_api: ServerThread, redis_url: str) -> None:
    job, other = _create(keyed_api, AUTH), _create(keyed_api, AUTH)
    events = f"/v1/jobs/{job['id']}/events"
    expiry, _, signature = job["token"].partition(".")
    assert _error_code(_events(keyed_api, events)) == (401, "invalid_api_key")  # no token, no key
    for wrong in (
        other["token"],  # another job's
        f"{expiry}.{signature[::-1]}",
        f"{int(expiry) + 3600}.{signature}",  # a longer life, not signed
        "garbage",
        "9" * 5000 + ".x",  # not parsed as an int that large
        KEY,
    ):
        assert _error_code(_events(keyed_api, f"{events}?token={wrong}")) == (403, "invalid_job_token"), wrong
    expired = JobTokens((KEY, "sk-other")).issue(job["id"], time.time() - 3600)  # as another node would sign it
    assert _error_code(_events(keyed_api, f"{events}?token={expired}")) == (401, "job_token_expired")
    foreign = JobTokens(("sk-unrelated",)).issue(job["id"], time.time())  # a server with other keys
    assert _error_code(_events(keyed_api, f"{events}?token={foreign}")) == (403, "invalid_job_token")
    # the token opens the events only: status and DELETE still need the key
    for method, path in (("GET", f"/v1/jobs/{job['id']}"), ("DELETE", f"/v1/jobs/{job['id']}")):
        resp = httpx.request(method, f"{keyed_api.url}{path}?token={job['token']}", timeout=10)
        assert resp.status_code == 401, (method, resp.text)


async def test_status_gives_a_fresh_token(keyed_api: ServerThread, redis_url: str) -> None:
    job = _create(keyed_api, {"Authorization": "Bearer sk-other"})
    await ScriptedWorker(redis_url).serve()
    status = httpx.get(f"{keyed_api.url}/v1/jobs/{job['id']}", headers={"Authorization": "Bearer sk-other"}).json()
    assert status["status"] == "completed" and status["token"]
    assert _events(keyed_api, status["events_url"]).status_code == 200


async def test_without_keys_no_token_is_needed(redis_server: RedisServer, redis_url: str) -> None:
    api = start_api(redis_server)
    try:
        job = _create(api, {})
        await ScriptedWorker(redis_url).serve()
        assert "token" not in job and job["events_url"] == f"/v1/jobs/{job['id']}/events"
        assert _events(api, job["events_url"] + "?token=anything").status_code == 200  # auth is off: ignored
    finally:
        api.stop()


def test_tokens_expire_and_bind_the_job() -> None:
    tokens = JobTokens(("a", "b"), ttl_s=60)
    token = tokens.issue("job-1", now=1000.0)
    JobTokens(("b", "a")).check(token, "job-1", now=1059.0)  # any node with the same keys, in any order
    with pytest.raises(Exception, match="expired"):
        tokens.check(token, "job-1", now=1060.0)
    with pytest.raises(Exception, match="invalid token"):
        tokens.check(token, "job-2", now=1000.0)
