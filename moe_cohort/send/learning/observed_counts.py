"""The engine's expert counts of finished requests (traces.observed.Observed), as the proxy gets them.

- Our plugin (`ObservedCounts`): a body `mark`ed with `vllm_xargs.moe_observe` = a token has its request's
  experts counted in the engine; once the request left its replica (`finished`), that replica hands the counts
  over at `POST /v1/cohort/observed` (engine.observed_endpoint), asked every POLL_S (or the caller's `poll_s`) while tokens wait, a token
  given up after GIVE_UP_S. Streamed or not, embedded or across containers. Bodies are marked only once a
  replica said it serves that route (`ask_served` asks them all); one that answers 404/405 does not, and a warning
  says so; when none does, nothing is marked.
- vLLM's `routed_experts` field (`routed_answer`, `routed_counts`): a non-streamed answer of a server started
  with `--enable-return-routed-experts` carries, per choice, base64 `.npy` [tokens - 1, L, k], read with the
  answer's `usage.prompt_tokens`; `without_routed` strips it from what a client that did not ask receives.

Knows nothing of what the counts are for: each goes to `deliver(text, counts, kept)` (`kept`: what the caller
said of the request when it marked it), each one lost to `lost(reason, how_many)`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import secrets
import time
from typing import Callable, Sequence

from moe_cohort.admission.wire import OBSERVE_KEY, with_xargs
from moe_cohort.send.backend_client import BackendClient
from moe_cohort.send.errors import BackendStatusError, ServiceError
from moe_cohort.traces.observed import BadObservation, Observed, decode_npy, from_routed_experts

log = logging.getLogger(__name__)

OBSERVED_PATH = "/v1/cohort/observed"
ROUTED_EXPERTS, PROMPT_START = "routed_experts", "routed_experts_prompt_start"
LIVE_ONLY = "-live"  # the end of the token of a request marked with kept=False
POLL_S, GIVE_UP_S, MAX_TAKE = 0.5, 60.0, 4096  # MAX_TAKE: engine.observed_endpoint.MAX_TOKENS
ASK_EVERY_S = 10.0  # how often a backend that did not answer whether it serves the counts is asked again

Deliver = Callable[[str, Observed, bool], None]  # (the request's text, its counts, kept)
Lost = Callable[[str, int], None]  # (why: "invalid" or "unclaimed", how many)
Waiting = dict[str, tuple[str, float, bool]]  # token -> (text, when it finished, kept)


def _nothing(*_) -> None:
    return None


class ObservedCounts:
    """Our plugin's counts: marks request bodies, then takes the counts of finished ones from their replicas."""

    def __init__(self, replicas: Sequence[BackendClient], deliver: Deliver, lost: Lost = _nothing,
                 cpu: Callable[[float], None] = _nothing, poll_s: float = POLL_S) -> None:
        self.replicas = list(replicas)  # each asked whether it serves OBSERVED_PATH
        self.poll_s = poll_s  # how often the counts of finished requests are asked for while some wait
        self.serves: bool | None = None  # whether one does (None: not known yet)
        self._deliver, self._lost, self._cpu = deliver, lost, cpu  # cpu(s): event-loop CPU seconds taking counts
        self._ask_after, self._asking = 0.0, set()
        prefix = secrets.token_hex(4)  # this proxy's: several proxies may share a backend
        self._tokens = (f"{prefix}-{n}" for n in itertools.count())
        self._waiting: dict[BackendClient, Waiting] = {}
        self._poller: asyncio.Task | None = None

    def mark(self, body: dict, kept: bool) -> None:
        """Have the engine count the experts of the request `body` is about to send; the token carries `kept`
        (a request may never finish, so nothing else remembers it)."""
        token = next(self._tokens) + ("" if kept else LIVE_ONLY)
        body["vllm_xargs"] = with_xargs(body.get("vllm_xargs"), **{OBSERVE_KEY: token})

    async def ask_served(self) -> None:
        """Ask the replicas now whether they serve the counts (at start-up, so the first requests get marked)."""
        if self.replicas and self.serves is None:
            self._ask_after = time.monotonic() + ASK_EVERY_S
            await self._ask_all()

    def ask_served_soon(self) -> None:
        """Ask the replicas in the background whether they serve the counts, at most every ASK_EVERY_S."""
        if not self.replicas or time.monotonic() < self._ask_after:
            return
        self._ask_after = time.monotonic() + ASK_EVERY_S
        task = asyncio.get_running_loop().create_task(self._ask_all())
        self._asking.add(task)
        task.add_done_callback(self._asking.discard)

    async def _ask_all(self) -> None:
        """Served when one replica serves them, not served when every one said it does not, else not known yet."""
        said = await asyncio.gather(*(self._ask(client) for client in self.replicas))
        self.serves = True if True in said else False if all(s is False for s in said) else None

    async def _ask(self, client: BackendClient) -> bool | None:
        """200 with the route's shape: it serves them; 404/405: it does not; anything else: not known yet."""
        try:
            answer = await client.request("POST", OBSERVED_PATH, json={"tokens": []})
            serves = isinstance(json.loads(answer.content).get("observed"), dict)
        except BackendStatusError as exc:
            if exc.status_code not in (404, 405):
                return None
            serves = False
        except (ServiceError, ValueError, AttributeError):
            return None
        if not serves:
            log.warning("learning: %s has no %s, so the proxy learns from vLLM's routed_experts answers only; for our "
                        "plugin's counts run vLLM with it and VLLM_PLUGINS=moe_cohort (cohort serve's embedded vLLM "
                        "does)", client.base_url, OBSERVED_PATH)
        return serves

    def finished(self, client: BackendClient, body: dict, text: str) -> None:
        """The request `body` left `client` (answered, failed or abandoned): when marked, take its counts soon."""
        token = (body.get("vllm_xargs") or {}).get(OBSERVE_KEY)
        if token is None or self.serves is False:
            return
        self._waiting.setdefault(client, {})[token] = (text, time.monotonic(), not token.endswith(LIVE_ONLY))
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    def waiting_on(self) -> set[str]:
        """The base URLs of the replicas that finished requests whose counts were not taken yet."""
        return {client.base_url for client, waiting in self._waiting.items() if waiting}

    async def flush(self, timeout_s: float = 5.0) -> None:
        """Take the counts still waiting now, until none waits or `timeout_s` passed (the poller would, later)."""
        deadline = time.monotonic() + timeout_s
        while self._waiting and time.monotonic() < deadline:
            await self._take_all()
            if self._waiting:
                await asyncio.sleep(0.05)

    def close(self) -> None:
        """Stop polling; the counts still waiting are not taken."""
        if self._poller is not None:
            self._poller.cancel()

    async def _poll(self) -> None:
        while self._waiting:
            await asyncio.sleep(self.poll_s)
            await self._take_all()

    async def _take_all(self) -> None:
        for client in list(self._waiting):
            try:
                await self._take(client, self._waiting[client])
            except Exception:  # a bug or a broken answer must not stop the polling
                log.exception("taking observed expert counts from %s failed", client.base_url)
            if not self._waiting.get(client):
                self._waiting.pop(client, None)

    async def _take(self, client: BackendClient, waiting: Waiting) -> None:
        try:
            answer = await client.request("POST", OBSERVED_PATH, json={"tokens": list(waiting)[:MAX_TAKE]})
        except ServiceError:  # unreachable now (or a replica without the plugin): the tokens wait, and expire
            answer = None
        started = time.thread_time()
        for token, obj in (json.loads(answer.content).get("observed", {}) if answer else {}).items():
            if token in waiting:
                self._hand_over(waiting.pop(token), obj)
        self._expire(waiting)
        self._cpu(time.thread_time() - started)

    def _hand_over(self, entry: tuple[str, float, bool], obj: object) -> None:
        text, _, kept = entry
        try:
            counts = Observed.from_wire(obj)
        except BadObservation as exc:
            self._lost("invalid", 1)
            log.warning("cannot read the plugin's counts of a request: %s", exc)
            return
        self._deliver(text, counts, kept)

    def _expire(self, waiting: Waiting) -> None:
        expired = [t for t, (_, when, _) in waiting.items() if time.monotonic() - when > GIVE_UP_S]
        for token in expired:
            del waiting[token]
        if expired:
            self._lost("unclaimed", len(expired))


def marked(body: dict) -> bool:
    """Whether the request `body` was marked for the plugin's counts (they come for it, once)."""
    return OBSERVE_KEY in (body.get("vllm_xargs") or {})


def routed_answer(content: bytes) -> dict | None:
    """A non-streamed answer that carries vLLM's routed experts, parsed; None for any other content."""
    if b'"routed_experts"' not in content:
        return None
    try:
        answer = json.loads(content)
        return answer if isinstance(answer, dict) and isinstance(answer.get("choices") or [], list) else None
    except ValueError:
        return None


def one_routed_choice(answer: dict) -> bool:
    """Whether the answer has one choice, with routed experts (only then are they one request's)."""
    choices = answer.get("choices") or []
    return len(choices) == 1 and isinstance(choices[0], dict) and bool(choices[0].get(ROUTED_EXPERTS))


def routed_counts(answer: dict, body: dict, num_experts: int | None) -> Observed:
    """The counts of the answer's one choice's routed experts (the request sent `body`) over `num_experts`
    experts (None: as many as the highest id seen needs). Raises BadObservation for a malformed answer."""
    try:
        rows = decode_npy(answer["choices"][0][ROUTED_EXPERTS])  # [tokens - 1, L, k]
        prompt_tokens = int((answer.get("usage") or {})["prompt_tokens"])
        width = num_experts or int(rows.max(initial=0)) + 1
        return from_routed_experts(rows, prompt_tokens, width, int(body.get(PROMPT_START) or 0))
    except BadObservation:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise BadObservation(f"a malformed answer: {exc!r}") from exc


def without_routed(answer: dict) -> bytes:
    """The answer's content with every choice's routed experts taken out (`answer` is left as it is)."""
    choices = [{k: v for k, v in c.items() if k != ROUTED_EXPERTS} if isinstance(c, dict) else c
               for c in answer.get("choices") or []]
    return json.dumps({**answer, "choices": choices}, separators=(",", ":")).encode()


def client_answer(content: bytes, body: dict) -> tuple[bytes, dict | None]:
    """A non-streamed answer's content as the client gets it (vLLM's routed experts stripped unless the client
    asked for them; `body`: the request sent), and the parsed answer when it carries routed experts (else None)."""
    answer = routed_answer(content)
    if answer is None:
        return content, None
    return (content if body.get(PROMPT_START) is not None else without_routed(answer)), answer
