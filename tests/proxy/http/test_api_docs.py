"""The API docs routes: off by default, behind the key when turned on, a setting and a flag."""

from __future__ import annotations

from moe_cohort.embedded.vllm_server import free_port
from moe_cohort.send.settings import Settings
from tests.helpers.proxy_thread import ProxyThread


DOCS_ROUTES = ["/openapi.json", "/docs", "/redoc", "/docs/oauth2-redirect"]


def _docs_proxy(tmp_path, **settings):
    return ProxyThread(Settings(backends=("http://127.0.0.1:9",), port=free_port(), encoder="none",
                                data_dir=str(tmp_path), **settings))


def test_api_docs_are_off_by_default_even_with_a_key(tmp_path):
    import httpx

    for keys in ((), ("sekrit",)):
        with _docs_proxy(tmp_path, api_keys=keys) as p:
            for path in DOCS_ROUTES:
                resp = httpx.get(p.url + path, headers={"authorization": "Bearer sekrit"} if keys else {})
                assert resp.status_code == 404, (keys, path, resp.text)
                assert resp.json()["error"]["type"] == "invalid_request_error"


def test_api_docs_turned_on_are_behind_the_key(tmp_path):
    import httpx

    with _docs_proxy(tmp_path, api_keys=("sekrit",), api_docs=True) as p:
        for path in DOCS_ROUTES[:3]:
            refused = httpx.get(p.url + path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", path
            assert httpx.get(p.url + path, headers={"authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(p.url + path, headers={"authorization": "Bearer sekrit"}).status_code == 200, path
        schema = httpx.get(p.url + "/openapi.json", headers={"authorization": "Bearer sekrit"}).json()
        assert "/v1/chat/completions" in schema["paths"] and "/openapi.json" not in schema["paths"]
    with _docs_proxy(tmp_path, api_docs=True) as p:  # an open proxy: open docs
        assert httpx.get(p.url + "/docs").status_code == 200


def test_api_docs_setting():
    from moe_cohort.send.setting_sources import load_settings

    assert load_settings(environ={"COHORT_API_DOCS": "true"}).api_docs is True
    assert load_settings(environ={}).api_docs is False
