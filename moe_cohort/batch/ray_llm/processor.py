"""Expert-aware batches in Ray Data LLM: rows that fit go through the engine together, each with its profile.

    from ray.data.llm import vLLMEngineProcessorConfig
    from moe_cohort.batch.ray_llm import ExpertAware

    aware = ExpertAware.load()                       # each row's prompt probed by the engine orders the Dataset
    processor = aware.build_processor(config, preprocess=preprocess, postprocess=postprocess)
    out = processor(ds).materialize()                # the plain processor's outputs, one per row

What each step keeps:
- `order` (which the processor applies to the Dataset it is given) sends the Dataset in the batch runner's order
  (batch/order.py: admission by expert profiles, max_num_seqs at a time, first in first out), keeping every row
  and column; it adds `moe_row` (the row's place in the Dataset as given) and `moe_profile` (its compact profile,
  [] when none).
- A probing run (the default) first sends every row as a probe: a copy with the `moe_probe` column true, which
  asks one token of the same prompt (batch/probe_request.py) under a `moe_observe` token, so that our plugin
  counts the prompt's experts. The engine stage (batch/ray_llm/engine.py) hands each probe's counts to a Ray
  actor (batch/ray_llm/box.py); once every probe is answered, a driver thread orders the rows by their prompts'
  profiles (`probed_plan`) and hands them over in parts, each with its profiles, in the same execution (one
  engine start). The probes' answers are dropped from the output. The engine's own routing of a prompt predicts
  its answer's routing far better than a head that reads the text (docs/results.md).
- Without probing, `order` predicts every row's profile from its text (`messages` or `prompt`, as the proxy reads
  a body: the static encoder and the head learned in the data dir) and plans the whole Dataset up front.
- `build_processor` is Ray's `build_processor` with the engine set up for admission by experts: our scheduler
  (`scheduler_cls`) and plugin (`VLLM_PLUGINS`), unless the config names others; `max_pending_requests` at
  PENDING_PER_SLOT x max_num_seqs, so that vLLM's waiting queue holds rows for our scheduler to choose from
  (Ray's default keeps about a tenth of max_num_seqs waiting); the user's preprocess output gets the row's
  profile in `sampling_params.extra_args` (where our scheduler reads it) and, while probing or learning, a
  `moe_observe` token under which the plugin counts the request's experts. Called with a Dataset, the processor
  orders it (`order`, for the config's max_num_seqs) and runs Ray's; its outputs are the plain ones.
- `learn` (with `learn=True`) fits the profile head on the counts the engine took of this run's answers and saves
  it in the data dir, where the next `load` without probes (and `cohort serve`) finds it.

One engine or several (`concurrency`): Ray Data sends each bundle of consecutive rows whole to one engine, so
rows the order put together run on the same engine. Nothing here needs the proxy.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from moe_cohort.batch.probe_request import probe_body, prompt_profile
from moe_cohort.batch.ray_llm.rows import part_sizes, plan, probed_plan, row_text, with_expert_args
from moe_cohort.send.profiles import Predictor

log = logging.getLogger(__name__)

SCHEDULER_CLS = "moe_cohort.engine.scheduler.ExpertAwareScheduler"
PLUGIN = "moe_cohort"
PENDING_PER_SLOT = 4  # rows inside vLLM per slot: the running ones and a waiting queue three times as deep
ROW, PROFILE, PROBE = "moe_row", "moe_profile", "moe_probe"  # the columns `order` adds
ENGINE_STAGE = "vLLMEngineStage"
HAND_OVER_JOIN_S = 10.0  # how long `learn` waits for a probing run's hand-over to end


class OrderingProcessor:
    """A Ray Data LLM processor that orders the Dataset it is given (`ExpertAware.order`) before it runs."""

    def __init__(self, processor, aware: ExpertAware, remote: dict | None = None) -> None:
        self.processor, self.aware, self.remote = processor, aware, remote or {}

    def __call__(self, ds):
        out = self.processor(self.aware.order(ds))
        if not self.aware.probe:
            return out
        from moe_cohort.batch.ray_llm.source import without

        # with the postprocessing's resources, so that Ray fuses the two (a task of a whole CPU would wait)
        return out.map_batches(without, fn_args=(PROBE,), batch_format="pyarrow", **self.remote)

    def __getattr__(self, name: str):
        return getattr(self.processor, name)


def _taken(taken: dict[str, dict]):
    """(row, its counts) for each of the engine's counts `taken` (by observe token, which ends in the row) that
    reads as counts; the others are logged and left out."""
    from moe_cohort.traces.observed import BadObservation, Observed

    for token, wire in taken.items():
        row = int(token.rsplit("-", 1)[1])
        try:
            yield row, Observed.from_wire(wire)
        except BadObservation as exc:
            log.warning("row %d: its counts are not used: %s", row, exc)


def _batch_size(stage) -> int | None:
    """A stage config's own batch size (a config object or its dict; True/False: none, the processor's)."""
    return stage.get("batch_size") if isinstance(stage, dict) else getattr(stage, "batch_size", None)


@dataclass
class ExpertAware:
    """Ordering, engine set-up and learning for one Ray Data LLM run (see the module doc)."""

    predictor: Predictor | None
    max_num_seqs: int = 16
    learner: Any = None  # train.online.OnlineLearner, or None: not learning
    folder: Any = None  # where `learn` saves (the data dir's learned/)
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    texts: dict[int, str] = field(default_factory=dict)  # by moe_row: what `learn` featurizes
    batch: int = 1  # rows the processor's stages take at a time (the lcm of their batch sizes)
    learned: int = 0  # rows of this run learned from so far
    probe: bool = False  # whether every row's prompt is probed first, and the rows ordered by the probes' counts
    probed: int = 0  # rows of this run ordered by their probe's profile
    _box: Any = None
    _handing_over: threading.Thread | None = None

    @classmethod
    def load(cls, data_dir: str | None = None, encoder: str = "static", *, probe: bool = True, learn: bool = False,
             max_num_seqs: int = 16) -> ExpertAware:
        """A run that probes every row's prompt first and orders by the probes (`probe`; as `cohort batch run`
        does), or else by the settings' encoder (`encoder`: as `cohort batch run --encoder`; "none": the Dataset's
        order, no probes) with the head learned in `data_dir` (the proxy's and the batch runner's); learning into
        that head with `learn`. A probing run that does not learn loads no encoder."""
        from moe_cohort.send.learning.learning import follow_learned, learned_folder, load_learner
        from moe_cohort.send.profiles import make_predictor
        from moe_cohort.send.setting_sources import load_settings

        overrides = {"encoder": encoder, **({"data_dir": data_dir} if data_dir else {})}
        settings = load_settings(overrides)
        probe = probe and settings.encoder.lower() != "none"
        if probe and not learn:
            return cls(None, max_num_seqs, folder=learned_folder(settings), probe=True)
        predictor = make_predictor(settings)
        learner = load_learner(settings)
        aware = cls(predictor, max_num_seqs, learner if learn and predictor is not None else None,
                    learned_folder(settings), probe=probe)
        follow_learned(predictor, None, settings)  # ordering by the head learned there
        return aware

    def order(self, ds, text: Callable[[dict], str] = row_text):
        """`ds` in the order of admission by expert profiles, with `moe_row` and `moe_profile` added (a probing run:
        its probes, then the rows in the order the probes give: module doc); the returned Dataset keeps that order
        through the processor's stages (`preserve_order`). The rows are read into this process once: a plan of the
        whole Dataset needs all of them."""
        import ray.data

        rows = list(ds.iter_rows())
        texts = [text(r) for r in rows]
        self.texts = dict(enumerate(texts))
        rows = [{**r, ROW: i} for i, r in enumerate(rows)]
        if self.probe:
            out = self._probed(rows)
        else:
            order, profiles = plan(texts, self.predictor, self.max_num_seqs)
            ordered = [{**rows[i], PROFILE: profiles[i]} for i in order]
            log.info("ordered %d rows (%d with a profile)", len(rows), sum(bool(p) for p in profiles))
            out = ray.data.from_items(ordered,
                                      override_num_blocks=max(1, math.ceil(len(ordered) / self.max_num_seqs)))
        out.context.execution_options.preserve_order = True  # stages hand the engine its rows in this order
        return out

    def _probed(self, rows: list[dict]):
        """A probing run's Dataset: a probe of every row at once, then the rows in parts as `_order_by_probes` hands
        them over (one read task at a time, each waiting for its part); probes and parts in blocks of an
        engine-full in whole batches (each block goes whole to one engine, and each is one task per stage)."""
        import ray.data

        from moe_cohort.batch.ray_llm.box import handed_over
        from moe_cohort.batch.ray_llm.source import PartsSource

        rows = [{**r, PROBE: False} for r in rows]
        size = math.ceil(PENDING_PER_SLOT * self.max_num_seqs / self.batch) * self.batch  # an engine-full
        parts = part_sizes(len(rows), size)
        box = self._observations()
        self._handing_over = threading.Thread(target=self._order_by_probes, args=(rows, parts),
                                              name="moe-cohort-probed-order", daemon=True)
        self._handing_over.start()
        log.info("probing the prompts of %d rows, then sending them in the order the engine's routing gives",
                 len(rows))
        source = PartsSource([{**r, PROBE: True} for r in rows], functools.partial(handed_over, box), parts,
                             PROFILE, size)
        return ray.data.read_datasource(source, override_num_blocks=1 + len(parts), num_cpus=0, concurrency=1)

    def _order_by_probes(self, rows: list[dict], parts: list[int]) -> None:
        """Once every probe is answered, the rows in admission order by their prompts' profiles, given to the box in
        parts, each row with its profile; whatever fails, in the Dataset's order without profiles (the source
        waits for every part)."""
        import ray

        order, profiles = list(range(len(rows))), [[] for _ in rows]
        try:
            ray.get(self._box.until.remote(None, len(rows)))
            found = {}
            for row, counts in _taken(ray.get(self._box.take.remote())):
                found[row] = prompt_profile(counts)  # [L, E]
            order, profiles = probed_plan(len(rows), found, self.max_num_seqs)
            self.probed = len(found)
            log.info("%d of %d rows ordered by their prompts' routing", len(found), len(rows))
        except Exception:  # noqa: BLE001 (the run goes on without the order)
            log.exception("cannot order the rows by their probes; they go in the Dataset's order")
        at = 0
        for k, size in enumerate(parts):
            part = order[at:at + size]
            self._box.hand_over.remote(k, [rows[i] for i in part], [profiles[i] for i in part])
            at += size

    def configure(self, config):
        """A copy of the vLLMEngineProcessorConfig `config` set up for admission by experts (module doc)."""
        engine = {"scheduler_cls": SCHEDULER_CLS, **(config.engine_kwargs or {})}
        self.max_num_seqs = int(engine.get("max_num_seqs") or self.max_num_seqs)
        stages = [getattr(config, name) for name in type(config).model_fields if name.endswith("_stage")]
        self.batch = math.lcm(config.batch_size, *filter(None, map(_batch_size, stages)))
        runtime = dict(config.runtime_env or {})
        env = dict(runtime.get("env_vars") or {})
        plugins = [p for p in env.get("VLLM_PLUGINS", PLUGIN).split(",") if p]
        env["VLLM_PLUGINS"] = ",".join(plugins if PLUGIN in plugins else [*plugins, PLUGIN])
        if self.learner is not None or self.probe:
            from moe_cohort.batch.ray_llm.box import ENV_BOX

            env[ENV_BOX] = self._observations()
        pending = config.max_pending_requests or PENDING_PER_SLOT * self.max_num_seqs
        return config.model_copy(update={"engine_kwargs": engine, "runtime_env": {**runtime, "env_vars": env},
                                         "max_pending_requests": pending})

    def build_processor(self, config, preprocess: Callable[[dict], dict] | None = None,
                        postprocess: Callable[[dict], dict] | None = None, **kwargs):
        """Ray's `build_processor(self.configure(config), ...)`, each row's preprocess output given its expert args
        (a probe's: one token of the same prompt, counted), (while probing or learning) the engine stage that hands
        the engine's counts on, and the Dataset it is called with ordered first (and, probing, the probes' answers
        dropped from its output)."""
        from ray.data.llm import build_processor

        run, learning, probing = self.run, self.learner is not None, self.probe

        def expert_preprocess(row: dict) -> dict:
            out = dict(preprocess(row) if preprocess else row)
            params = out.get("sampling_params")
            if row.get(PROBE):
                out["sampling_params"] = with_expert_args(probe_body(params or {}), (), f"{run}-probe-{row[ROW]}")
                return out
            token = f"{run}-{row[ROW]}" if learning and ROW in row else None
            out["sampling_params"] = with_expert_args(params, row.get(PROFILE, ()), token)
            return out

        def probe_postprocess(row: dict) -> dict:  # the probe column kept, for the processor to drop its rows
            return {**(postprocess(row) if postprocess else row), PROBE: bool(row.get(PROBE))}

        processor = build_processor(self.configure(config), preprocess=expert_preprocess,
                                    postprocess=probe_postprocess if probing else postprocess, **kwargs)
        if learning or probing:
            from moe_cohort.batch.ray_llm.engine import ObservingEngineUDF

            # a copy, not an assignment: assigning re-runs the stage's validation, which resolved (and removed)
            # its placement group once already, and would ask for a GPU
            stage = processor.get_stage_by_name(ENGINE_STAGE)
            processor.stages[ENGINE_STAGE] = stage.model_copy(update={"fn": ObservingEngineUDF})
        return OrderingProcessor(processor, self, kwargs.get("postprocess_map_kwargs"))

    def learn(self) -> int:
        """Fit the head on the engine's counts of this run's rows and save it in the data dir; how many rows it
        learned from in this run (0 when not learning, or nothing came back)."""
        if self.learner is None or self._box is None:
            return 0
        import ray

        if self._handing_over is not None:
            self._handing_over.join(HAND_OVER_JOIN_S)  # a run that ended has handed every part over long before
            if self._handing_over.is_alive():
                log.warning("the run ended before its last rows were sent; nothing learned from it")
                return 0
        self._fit(ray.get(self._box.take.remote()))
        if self.learned:
            self.learner.save(self.folder)
            log.info("learned from %d rows; head saved in %s", self.learned, self.folder)
        return self.learned

    def _fit(self, taken: dict[str, dict]) -> None:
        """Observe the engine's counts `taken` (by observe token) and refit the head on everything observed."""
        from moe_cohort.send.learning.behind_serving import fit_apart

        pairs = list(_taken(taken))
        if not pairs:
            return
        rows, observed = [r for r, _ in pairs], [o for _, o in pairs]
        features, predicted = self.predictor.features([self.texts.get(r, "") for r in rows])  # [n, F]
        self.learner.observe(features, observed, predicted)
        self.learned += len(rows)
        if self.learner.reservoir.size >= 2:
            self.learner.refit(fit_apart)

    def _observations(self) -> str:
        """The name of this run's observation box (a Ray actor, started here once)."""
        from moe_cohort.batch.ray_llm.box import ObservationBox

        name = f"moe-cohort-observations-{self.run}"
        if self._box is None:
            self._box = ObservationBox.options(name=name, lifetime=None).remote()
        return name
