"""The proxy's keys (a client needs one of them) and the backend's key (sent on, never the client's)."""



from tests.helpers.proxy_client import CHAT, proxy_client, run
from tests.helpers.vllm_stub import OK_BODY, answer


def test_proxy_keys_and_backend_key():
    seen = []

    async def backend(request):
        seen.append(request.headers.get("authorization"))
        return answer(OK_BODY)

    async def main():
        async with proxy_client(backend, api_keys=("secret",), backend_api_key="vllm-key") as c:
            statuses = [(await c.post("/v1/chat/completions", json=CHAT)).status_code]
            wrong = await c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
            statuses.append((await c.post("/v1/chat/completions", json=CHAT,
                                          headers={"Authorization": "Bearer secret"})).status_code)
        async with proxy_client(backend) as c:
            statuses.append((await c.post("/v1/chat/completions", json=CHAT,
                                          headers={"Authorization": "Bearer client-key"})).status_code)
        return statuses, wrong

    statuses, wrong = run(main())
    assert statuses == [401, 200, 200] and wrong.json()["error"]["code"] == "invalid_api_key"
    assert seen == ["Bearer vllm-key", "Bearer client-key"]
