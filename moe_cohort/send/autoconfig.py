"""How the proxy serves each replica, chosen from what the replica says it is (send/handshake.py).

Rules (a setting the user gave wins over each of them):

- Where admission runs. A replica whose vLLM runs moe_cohort's ExpertAwareScheduler admits inside
  the engine: the proxy forwards every request at once with its predicted profile, holding at most
  ENGINE_SIDE_SLOTS (or 4 x max_num_seqs) there, so that the engine's queue is where the choice is
  made. Any other replica admits in the proxy: it holds max_num_seqs requests there, the engine's
  slots, and chooses among the rest when one frees. Setting: forward_profiles.
- Slots. The replica's max_num_seqs; UNKNOWN_SLOTS (vLLM's default) when it does not say, which
  leaves nothing waiting in the proxy, so a plain vLLM is served first come, first served unless
  the user gives its max_num_seqs. Setting: max_in_flight.
- Fairness. Besides max_queue_ms, a waiting request goes first once PASSED_PER_SLOT times a replica's slots
  of later arrivals were admitted before it (`passed_bound`), as vLLM's queue does with our scheduler.
  Setting: max_passed.
- Learning. On when a replica serves its expert counts (the endpoint plugin is loaded); off with
  `--encoder none`, or when no replica counts experts. Setting: learn.
- Batches (`plan_batch`: `cohort batch run`, the Batch API). A batch knows every line from the start, so its
  runner chooses each line from the whole file, in the proxy, whatever the engine's scheduler: it keeps
  max_num_seqs requests at the replica plus a queue as deep (`batch_fed`), so that vLLM refills freed slots at
  once, first come, first served from that queue, even when a whole engine-full finishes at the same step. No
  profile is forwarded unless asked: the
  engine's choice among a few queued lines saved nothing more and cost engine time per step
  (docs/results.md). Setting: batch_max_in_flight, else max_in_flight; forward_profiles.
  Where vLLM's scheduler prefills ahead (engine.scheduler), each line's prompt is routed in its own prefill
  and the engine admits to decode by that routing: no probe, and the runner keeps the engine's slots, the
  requests it holds ahead and a queue as deep as its slots there (`batch_fed`), in file order.

Pure: no I/O; the proxy asks the replicas and applies the plan (proxy/app.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from moe_cohort.admission.fairness import PASSED_PER_SLOT
from moe_cohort.engine.engine_info import SCHEDULER_CLS
from moe_cohort.send.handshake import UNREACHABLE, EngineInfo
from moe_cohort.send.settings import Settings

UNKNOWN_SLOTS = 256  # vLLM's default max_num_seqs
ENGINE_SIDE_SLOTS = 256  # at least this many requests forwarded to an engine that admits by itself
QUEUE_SHARE, QUEUE_MIN = 4, 2  # online requests' queue at an engine that admits by itself: S / 4, at least 2
TURN_ON_SCHEDULER = f"start vLLM with --scheduler-cls {SCHEDULER_CLS} to run admission inside it"
INSTALL_PLUGIN = ("install moe-cohort in vLLM's environment (its plugin tells the proxy max_num_seqs and serves the "
                  "expert counts learning reads), or give --max-in-flight = vLLM's --max-num-seqs")
UNKNOWN_SEQS = ": its max_num_seqs unknown, so nothing waits in the proxy and requests go first come, first served"
TURN_ON_COUNTS = "start vLLM with VLLM_PLUGINS=moe_cohort: it then serves the expert counts the proxy learns from"


@dataclass(frozen=True)
class ReplicaPlan:
    max_in_flight: int  # requests the proxy lets be at this replica at once
    engine_side: bool  # admission inside vLLM: forward at once, with the predicted profile
    why: str  # what was chosen and why, one clause
    could: str = ""  # what the user could turn on ("" when nothing)


@dataclass(frozen=True)
class LearningPlan:
    on: bool | None  # None: not decided yet (no replica has answered)
    why: str
    could: str = ""


def plan_replica(settings: Settings, info: EngineInfo) -> ReplicaPlan:
    """How to serve online requests at one replica that answered the handshake with `info`."""
    engine_side = info.expert_aware if settings.forward_profiles is None else settings.forward_profiles
    slots = settings.max_in_flight or (max(ENGINE_SIDE_SLOTS, 4 * (info.max_num_seqs or 0)) if engine_side
                                       else info.max_num_seqs or UNKNOWN_SLOTS)
    given = " (--max-in-flight)" if settings.max_in_flight else ""
    if engine_side:
        who = "moe-cohort's scheduler" if info.expert_aware else "--forward-profiles"
        return ReplicaPlan(slots, True, f"admission inside vLLM ({who}): forwarded at once with predicted profiles, "
                                        f"up to {slots} at a time{given}")
    if info.source == UNREACHABLE:
        return ReplicaPlan(slots, False, f"not answering yet: admission in the proxy, {slots} slots{given} until it "
                                         f"answers (asked again then)")
    if not info.plugin:
        return ReplicaPlan(slots, False, f"no moe-cohort plugin: admission in the proxy, {slots} slots{given}"
                                         f"{'' if given else UNKNOWN_SEQS}", INSTALL_PLUGIN)
    why = "--no-forward-profiles" if settings.forward_profiles is False else "vLLM runs its own scheduler"
    return ReplicaPlan(slots, False, f"{why}: admission in the proxy, {slots} slots"
                                     f"{given or ' (its max_num_seqs)'}", "" if settings.forward_profiles is False
                       else TURN_ON_SCHEDULER)


def plan_batch_replica(settings: Settings, info: EngineInfo) -> ReplicaPlan:
    """How to send a batch's lines to one replica that answered the handshake with `info` (the module docstring)."""
    given = settings.batch_max_in_flight or settings.max_in_flight
    seqs = info.max_num_seqs
    slots = given or (batch_fed(seqs, info.prefill_ahead) if seqs else UNKNOWN_SLOTS)
    forward = bool(settings.forward_profiles)
    said = " (--max-in-flight)" if given else f" ({seqs} for its max_num_seqs and a queue of {slots - seqs})" \
        if seqs else UNKNOWN_SEQS
    if info.prefill_ahead:
        return ReplicaPlan(slots, forward, f"each line's prompt routed in its own prefill, and admitted to decode by "
                                           f"that routing inside vLLM (its scheduler prefills {info.prefill_ahead} "
                                           f"ahead), {slots} at a time{said}")
    with_profiles = ", with predicted profiles (--forward-profiles)" if forward else ""
    why = "not answering yet: " if info.source == UNREACHABLE else "no moe-cohort plugin: " if not info.plugin else ""
    return ReplicaPlan(slots, forward, f"{why}each line chosen from the whole file in the proxy, {slots} at a time"
                                       f"{said}{with_profiles}", "" if info.plugin else INSTALL_PLUGIN)


def fed(max_num_seqs: int) -> int:
    """Requests at an engine of `max_num_seqs` slots that keep it fed: its slots, and a short queue of its own
    (a quarter more, at least QUEUE_MIN) that vLLM refills a freed slot from at once."""
    return max_num_seqs + max(QUEUE_MIN, max_num_seqs // QUEUE_SHARE)


def batch_fed(max_num_seqs: int, prefill_ahead: int = 0) -> int:
    """A batch's lines at an engine of `max_num_seqs` slots: its slots and a queue as deep. Lines of one length
    (as a batch's often are) admitted together finish at the same step; vLLM then refills every slot from its own
    queue while their answers travel back and the next lines come in, instead of running empty until they do
    (which, on a machine where vLLM's busy-waiting processes share the cores with its API server, takes seconds).
    An engine that prefills ahead holds `prefill_ahead` more, whose choice it makes: those come on top."""
    return 2 * max_num_seqs + prefill_ahead


def fed_at(infos: Sequence[EngineInfo]) -> int:
    """Requests at the backends from which every engine is fed (`fed`), so that a request may wait for its
    prediction without an engine slot idling (send/gate.py); an engine that does not say its max_num_seqs adds
    nothing."""
    return sum(fed(info.max_num_seqs) for info in infos if info.max_num_seqs)


def passed_bound(plans: Sequence[ReplicaPlan]) -> int:
    """How many later arrivals the proxy may admit before a waiting request (admission.waiting): PASSED_PER_SLOT
    times the slots of the smallest replica that admits in the proxy, so that no request waits more than a few
    rounds of that replica's slots longer than first come, first served would have made it wait."""
    slots = [p.max_in_flight for p in plans if not p.engine_side] or [p.max_in_flight for p in plans]
    return PASSED_PER_SLOT * min(slots)


def plan_learning(settings: Settings, infos: Sequence[EngineInfo]) -> LearningPlan:
    """Whether the proxy learns its profile head from the served model (None: ask again when a replica answers)."""
    if settings.encoder.lower() == "none":
        return LearningPlan(False, "learning off (--encoder none)")
    if settings.learn is not None:
        return LearningPlan(settings.learn, f"learning {'on (--learn)' if settings.learn else 'off (--no-learn)'}")
    if any(i.observed_counts for i in infos):
        return LearningPlan(True, "learning on: vLLM serves its expert counts (--no-learn turns it off)")
    if all(i.source == UNREACHABLE for i in infos):
        return LearningPlan(None, "learning decided when a replica answers")
    if any(i.plugin for i in infos):
        return LearningPlan(False, "learning off: vLLM does not serve its expert counts", TURN_ON_COUNTS)
    return LearningPlan(False, "learning off: no replica counts experts")


@dataclass(frozen=True)
class BatchPlan:
    """How a batch's lines go to its replicas (the same for each: the smallest replica's slots)."""

    max_in_flight: int  # lines out at each replica at once
    forward_profiles: bool  # each line carries its predicted profile (asked for: --forward-profiles)
    learn: bool  # the run learns its head from the engine's counts of its answers
    probe: bool  # each line's prompt is routed by the engine before its turn, and lines admitted by that routing
    line: str  # what was chosen and why (the run's first line)
    layers: int | None  # the model's MoE layers, when an engine said (decode loads per token in the summary)
    engine_orders: bool = False  # every engine prefills ahead and admits by the routing: the lines go in file order


def plan_batch(settings: Settings, urls: Sequence[str], infos: Sequence[EngineInfo], *,
               local: bool = False) -> BatchPlan:
    """How to run a batch on replicas that answered the handshake with `infos` (`plan_batch_replica`, and
    `plan_learning` as the proxy learns); `local`: `cohort batch run`'s own runner, which may probe (`plan_probe`).
    A run that probes learns only when asked: its order does not read the head."""
    plans = [plan_batch_replica(settings, info) for info in infos]
    probe, probed = plan_probe(settings, infos) if local else (False, "")
    engine_orders = bool(infos) and all(i.prefill_ahead for i in infos) and not probe
    learning = plan_learning(settings, infos)
    if (probe or engine_orders) and settings.learn is None and learning.on:
        learning = LearningPlan(False, "learning off: the engine's routing orders the lines (--learn also learns a "
                                       "head, for cohort serve)")
    layers = next((info.moe[0] for info in infos if info.moe), None)
    return BatchPlan(min(p.max_in_flight for p in plans), all(p.engine_side for p in plans), bool(learning.on), probe,
                     describe(urls, plans, learning) + (f" | {probed}" if probed else ""), layers,
                     engine_orders and not learning.on)


def plan_probe(settings: Settings, infos: Sequence[EngineInfo]) -> tuple[bool, str]:
    """Whether a batch run probes each line's prompt through the engine (batch/probe.py), and why."""
    if settings.encoder.lower() == "none":
        return False, "file order (--encoder none)"
    if settings.batch_probe is not None:
        return settings.batch_probe, f"probing {'on (--probe)' if settings.batch_probe else 'off (--no-probe)'}"
    if infos and all(i.prefill_ahead for i in infos):
        return False, "no probe: vLLM routes each prompt in its own prefill (--probe: a one-token probe first)"
    if infos and all(i.observed_counts for i in infos):
        return True, ("each line's prompt routed by the engine before its turn, lines admitted by that routing "
                      "(--no-probe: by the profile head)")
    return False, "probing off: vLLM does not serve its expert counts"


def describe(urls: Sequence[str], plans: Sequence[ReplicaPlan], learning: LearningPlan) -> str:
    """The one line the proxy logs (and `cohort serve` prints) at start: what was chosen, why, what could be on."""
    parts = [f"{url}: {p.why}" + (f"; to gain more: {p.could}" if p.could else "") for url, p in zip(urls, plans)]
    parts.append(learning.why + (f"; {learning.could}" if learning.could else ""))
    return "configured from the engines: " + " | ".join(parts)


def health(urls: Sequence[str], plans: Sequence[ReplicaPlan], learning: LearningPlan) -> dict:
    """What /health shows of the configuration (to callers allowed to see the backends)."""
    return {"replicas": [{"backend": url, "slots": p.max_in_flight, "admission": "engine" if p.engine_side else "proxy",
                          "why": p.why, **({"could": p.could} if p.could else {})} for url, p in zip(urls, plans)],
            "learning": {"on": learning.on, "why": learning.why, **({"could": learning.could} if learning.could else {})}}
