"""How one question is answered: :class:`AskOptions`, the policy of an :meth:`EdgeSession.ask`.

    opts = AskOptions(strategy="stream", level="q8", max_new_tokens=64)
    res = session.ask(context_id, question, opts)
    res = session.ask(context_id, question, opts, backend="dense")   # one field overridden

The defaults are what ``sparkv ask`` does with no flags (apart from its ``--max-new-tokens``). An
options object holds no state of an ask: one serves any number of asks, of any context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from sparkv.edge.engine import EngineConfig
from sparkv.edge.planning import AUTO_FLOOR, PRELUDE_STRATEGIES, STRATEGIES, AskError
from sparkv.runtime.attention import BACKENDS, AttentionBackend
from sparkv.runtime.jsonform import JsonForm
from sparkv.runtime.sampling import Sampling
from sparkv.scheduler.controller import ControllerConfig

#: the decode-time KV policy that keeps everything in RAM (no :mod:`sparkv.decode` policy)
FULL_DECODE = "full"
#: the default time limit of an ask: this many times the local-prefill estimate, plus
#: :data:`ASK_DEADLINE_SLACK_S` (docs/edge.md, "Bounds")
ASK_DEADLINE_FACTOR = 3.0
ASK_DEADLINE_SLACK_S = 10.0


@dataclass(frozen=True)
class AskOptions:
    """The policy of one ask; checked when made (:class:`AskError` for an unknown strategy or
    decode policy)."""

    strategy: str = "sparkv"
    """Planner + controller, one of :data:`sparkv.edge.planning.STRATEGIES` (``sparkv``,
    ``local``, ``stream``, ``hybrid``)."""

    level: str = "auto"
    """``auto``: the planner picks per chunk among the encoded levels at or above
    :attr:`quality_floor`; else one codec level name (``raw``, ``q8``, ``q5``, ...) for every
    streamed chunk."""

    quality_floor: str | None = AUTO_FLOOR
    """The lowest codec level a streamed chunk may use. ``auto``: the floor of this model's
    measured quality table (``sparkv bench quality --save-table``, docs/quality.md), ``q5``
    without one; when no encoded level meets the measured floor, the context is computed
    locally (``breakdown.fallback["quality"]``). ``None``: any level."""

    backend: str | AttentionBackend = "auto"
    """Attention backend of the local layer steps: a name (``auto``: block-sparse on the CPU,
    unless the model's quality table measured it failing the default policy's thresholds while
    dense passes, or the model computes attention's products in bf16 (``mixed-attn``): then
    ``dense``; :func:`~sparkv.edge.planning.default_backend`) or an
    :class:`~sparkv.runtime.attention.AttentionBackend`."""

    max_new_tokens: int = 32
    """Answer length cap (tokens, the first one included)."""

    bandwidth_mbps: float | None = None
    """The link estimate to plan with (Mbit/s). ``None``: the session's priors (the
    controller's throughput over the last load), else the manifest download's rate, else
    50 Mbit/s. The controller corrects it from measured rates either way, and a load whose
    link measures more than 1.5x below it re-plans once at the measured rate
    (:class:`~sparkv.scheduler.rules.Replan`)."""

    plan_receive_tax: bool = False
    """Plan with the session's learned receive tax (:attr:`Priors.receive_tax
    <sparkv.edge.session.Priors.receive_tax>`: how much slower the steps run while the link
    receives). Off by default: on a 2-core CPU it brought the simulated TTFT closer to the
    measured one but made the plans no faster in paired runs (session 67, docs/benchmarks.md);
    the session learns it and every load reports it either way."""

    use_cache: bool = True
    """Reuse a manifest the client already holds (no request)."""

    chat: bool = True
    """Format the question as a chat turn after a :func:`~sparkv.edge.prompts.chat_context`
    (``False``: its plain text tokens)."""

    engine_config: EngineConfig | None = None
    """The engine's knobs for this load (seconds, bytes); ``None``: the session's
    ``engine_config``, else :class:`~sparkv.edge.engine.EngineConfig` defaults."""

    controller: ControllerConfig | None = None
    """The controller's configuration, used when the ask runs its own strategy (not after a
    fallback to ``local``); ``None``: the strategy's own (:data:`STRATEGIES`)."""

    stop_at_eos: bool = True
    """Stop generating at the model's end-of-sequence token (``False``: always
    :attr:`max_new_tokens` tokens, as the benchmarks compare them)."""

    temperature: float = 0.0
    """How the answer's tokens are chosen: 0, the default, greedy (each token the argmax, what
    the quality tables measure); else sampled from the logits divided by it (at most 2;
    :class:`~sparkv.runtime.sampling.Sampling`)."""

    top_p: float = 1.0
    """Sampling only: draw from the most likely tokens whose probability reaches it (0..1)."""

    top_k: int = 0
    """Sampling only: draw from the ``top_k`` most likely tokens (0: all)."""

    seed: int | None = None
    """Sampling only: the seed of the draws (the same seed over the same context and question
    gives the same answer); ``None``: the ask draws one and reports it
    (``breakdown.seed``)."""

    frequency_penalty: float = 0.0
    """Taken off a token's logit once per time the answer so far holds it (-2..2), greedy or
    sampled."""

    presence_penalty: float = 0.0
    """Taken off a token's logit once the answer so far holds it (-2..2)."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    """``(token id, bias)`` pairs (or a dict) added to those tokens' logits (-100..100)."""

    form: JsonForm | None = None
    """The JSON the answer must be (OpenAI's ``response_format``; ``None``: any text): every
    token is chosen among those that keep the answer a prefix of such a value
    (:mod:`sparkv.runtime.jsonform`)."""

    stop: tuple[str, ...] = ()
    """Stop strings (OpenAI's ``stop``; a lone string is one stop string): at most
    :data:`~sparkv.runtime.stops.MAX_STOPS`, each at most
    :data:`~sparkv.runtime.stops.MAX_STOP_CHARS` characters. The answer ends at the token that
    completes one, and its text ends before it (:class:`~sparkv.runtime.stops.StopStrings`)."""

    keep: bool = False
    """Keep the loaded cache as a context of the session's ``context_service`` (after the
    answer); if the service already holds this context, answer from it: no manifest, no
    stream, only the question's prefill (plus restoring chunks it swapped out, from flash or by
    recomputation)."""

    decode: str = FULL_DECODE
    """The decode-time KV policy (:data:`sparkv.decode.POLICIES`; ``full``: everything in RAM);
    its stats go to ``breakdown.decode`` (docs/dynakv.md)."""

    ram_budget: float | None = None
    """RAM budget of :attr:`decode`: bytes, or a fraction <= 1 of the final KV; ``None``: the
    policy's default."""

    prelude: bool | None = None
    """Compute the first layer steps while the manifest and the plan are on their way
    (:mod:`sparkv.edge.prelude`; needs the context's tokens on the device). ``None``: on for
    the strategies in :data:`~sparkv.edge.planning.PRELUDE_STRATEGIES` (``sparkv``)."""

    ask_deadline_s: float | None = None
    """The ask's own time limit, seconds from the call: once it passes, the link is given up
    and every chunk still missing is computed locally (``breakdown.fallback["deadline"]``).
    ``None``: :data:`ASK_DEADLINE_FACTOR` x the local-prefill estimate (this device's cost
    model of the whole context and the question) + :data:`ASK_DEADLINE_SLACK_S`;
    ``math.inf``: no limit. Each request still has its own deadline (``ClientLimits``)."""

    def __post_init__(self) -> None:
        if self.ask_deadline_s is not None and not self.ask_deadline_s > 0:
            raise AskError(f"ask_deadline_s must be a positive number of seconds, "
                           f"not {self.ask_deadline_s!r}")
        self._check_stop()
        try:
            object.__setattr__(self, "logit_bias", self.sampling.logit_bias)   # a dict: pairs
        except (ValueError, TypeError) as e:
            raise AskError(str(e)) from None
        if self.strategy not in STRATEGIES:
            raise AskError(f"unknown strategy {self.strategy!r}; "
                           f"choose one of {sorted(STRATEGIES)}")
        if isinstance(self.backend, str) and self.backend not in BACKENDS:
            raise AskError(f"unknown attention backend {self.backend!r}; "
                           f"choose one of {list(BACKENDS)}")
        if self.uses_decode_policy:
            from sparkv.decode import POLICIES

            if self.decode not in POLICIES:
                raise AskError(f"unknown decode policy {self.decode!r}; "
                               f"choose one of {list(POLICIES)}")

    def _check_stop(self) -> None:
        from sparkv.runtime.stops import MAX_STOP_CHARS, MAX_STOPS

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not all(isinstance(x, str) for x in stop):
            raise AskError(f"stop must be strings, not {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stop))
        if len(self.stop) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in self.stop):
            raise AskError(f"stop takes at most {MAX_STOPS} strings of at most "
                           f"{MAX_STOP_CHARS} characters")

    @property
    def sampling(self) -> Sampling:
        """How the answer's tokens are chosen (:attr:`temperature`, :attr:`top_p`,
        :attr:`top_k`, :attr:`seed`, the penalties and :attr:`logit_bias`)."""
        return Sampling(self.temperature, self.top_p, self.top_k, self.seed,
                        self.frequency_penalty, self.presence_penalty, self.logit_bias,
                        self.form)

    def seeded(self) -> AskOptions:
        """These options with a seed when they sample without one (drawn from the OS, so the
        ask can report it); else these."""
        if self.sampling.greedy or self.seed is not None:
            return self
        return dataclasses.replace(self, seed=self.sampling.with_seed().seed)

    @property
    def uses_decode_policy(self) -> bool:
        """Whether generation goes through a :mod:`sparkv.decode` policy (anything but
        ``full`` without a RAM budget)."""
        return self.decode != FULL_DECODE or self.ram_budget is not None

    def time_limit_s(self, local_s: float) -> float:
        """The ask's time limit (s from the call) given the local-prefill estimate
        ``local_s`` (:attr:`ask_deadline_s`, its ``None`` resolved)."""
        if self.ask_deadline_s is not None:
            return float(self.ask_deadline_s)
        return ASK_DEADLINE_FACTOR * local_s + ASK_DEADLINE_SLACK_S

    @property
    def runs_prelude(self) -> bool:
        """:attr:`prelude`, its ``None`` resolved for :attr:`strategy`."""
        return self.prelude if self.prelude is not None else self.strategy in PRELUDE_STRATEGIES

    @classmethod
    def resolve(cls, options: AskOptions | None, overrides: Mapping[str, Any]) -> AskOptions:
        """``options`` (default: ``AskOptions()``) with ``overrides`` replacing fields.

        Raises:
            TypeError: ``options`` is not an :class:`AskOptions`, or an override names no field.
            AskError: the result is invalid (see the class)."""
        if options is None:
            options = cls()
        elif not isinstance(options, cls):
            raise TypeError(f"options must be {cls.__name__}, not {type(options).__name__}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {', '.join(map(repr, unknown))}: "
                            f"not fields of {cls.__name__}")
        return dataclasses.replace(options, **overrides) if overrides else options


def answer_form(args: Any) -> JsonForm | None:
    """The JSON form ``--json-object`` or ``--json-schema`` asks for (``None``: any text);
    :class:`AskError` for a schema the automaton cannot enforce."""
    from sparkv.runtime.jsonform import FormError

    if getattr(args, "json_schema", None) is not None:
        try:
            return JsonForm.from_schema(args.json_schema, "cli")
        except FormError as e:
            raise AskError(f"--json-schema: {e}") from None
    return JsonForm.any_object() if getattr(args, "json_object", False) else None

