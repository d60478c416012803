"""When to reconfigure, and to what: Packrat's control policy, pure.

The controller measures; this module decides.  It reads plain numbers (the
arrival rate over two windows, the queue depth, what swaps have cost so far)
and answers with a level to move to, or nothing.  No TorchServe, no threads,
no clock of its own: tests drive it with plain data.

Why the arrival rate and not the queue depth.  Packrat's paper sizes ``B``
from the observed queue depth.  A swap builds a backlog (the old set serves
while the new set starts), and a depth-driven estimator reads that backlog as
more load and swaps again: one step of load caused three swaps in
``docs/benchmarks/packrat_swap_resnet50.md``.  Arrivals are what the clients
send, so a backlog does not change them.

Each *level* (a power-of-two ``B``, its plan, and the latency it is
predicted to serve at a rate) is modelled in ``levels.py``.

A move happens only when all of these hold:

- **someone waited.** Growing on the rate needs a request that queued within
  the short window (more requests in the system at some sample than the
  current level's workers take): one client sending back to back reads as
  the fat worker's whole capacity, yet for one request at a time the fat
  worker is the fastest plan there is;

- **direction, beyond noise.** Arrivals are Poisson-noisy: 16 requests in
  a 2 s window say 8 ± 4 per second, enough to cross the boundary between
  two levels all the time.  So the *direction* of a move is decided on
  confidence bounds (``N ± z·√N`` arrivals in the window): growing needs the
  lower bound of the short-window rate (react to a step within ~2 s) or of
  the long-window rate (a slow rise, measured more tightly) to want a higher
  level; shrinking needs the upper bounds of the short *and* the long window
  to want a lower one (a lull is not a new load).  ``up_z`` (growing) and
  ``noise_z`` (shrinking) are separate knobs; both default to 2.  On the
  synthetic traces of tests/test_policy.py a narrower ``up_z`` = 1 did not
  react sooner (median 2.25 s against 2.5 s after a step) but gave a second
  move after 4 of 16 steps and moves under 6 of 30 constant loads.  The *target* is the best
  level at the upper bound of the short-window rate (a larger cap costs
  little), so one step of load gives one move, not a walk through the
  levels in between; unless a smaller level is better by ``min_gain`` in
  expectation over the rate's noise (on 16 cores the level best at the
  upper bound, 8×⟨2,1⟩, can be half again as slow per request as 2×⟨8,1⟩,
  which keeps up with all but the tail: ``growing_target``).
  With ``up_rule="expected"`` a move to another split of the cores (say
  one 2-thread worker → two 1-thread workers) may also grow when the long
  window says so *in expectation*: each level's latency is averaged over
  what the rate may really be (the Poisson noise of the long window's
  count), with the latency past a level's capacity taken as the backlog the
  expected stay at the load would build (finite, so it can be averaged).
  Why: the cost of being wrong is lopsided.  Below the crossover the split
  costs a few tens of ms per request; above it the fat worker's queue grows
  without bound.  Waiting for the lower bound waits, on a slow rise, until
  the fat worker is nearly saturated (the diurnal bench moved at 52.6 s of
  a 60 s rise).  Moves between batch caps of one split keep the bound rule:
  the model credits a larger cap for free, and in expectation would always
  drift to the largest.  The *worth it* test below still reads the measured
  rate, so a move still needs the split to be better at the rate as measured.
  Not the default: near the crossover a constant load's noisy long window
  sooner or later reads high enough, and the rule moves once under a load
  that did not change (bench/packrat_policy_sim.py: 11 of 24 seeds at a
  constant 8 req/s on the 2-core VM's profile, 0 under the bound rule);
- **persistence.** The same direction has been wanted for ``up_confirm_s``
  (growing) or ``down_confirm_s`` (shrinking): noise does not flap;
- **clean signal.** For ``depth_settle_s`` after a swap the queue-depth
  rules below are ignored: the old set drains beside the new one on the same
  cores, and the queue that builds meanwhile is the swap's, not the load's;
- **worth it.** The predicted latency improves by at least ``min_gain``
  (hysteresis around the boundary between two levels), and the latency
  saved over the expected time at the new load outweighs the swap's
  measured cost: ``λ·(W_cur − W_new)·(H − S) > λ·S·W_cur·κ``, with ``S`` the
  measured time until a swap of that kind serves (warm: the target worker
  set is already running; cold: it must start), ``H`` the learned time
  between load changes, ``κ`` the share of the serving set's speed that a
  swap of that kind takes away (a cold start competes for the cores).

A *step* the change detector flagged (``load_monitor.py``, a CUSUM on the
arrival process; a change of at least ``step_ratio`` either way) shortcuts
the windows: the new regime's rate (since the estimated change point) is
what a rise to another split of the cores is judged on, in expectation over
its Poisson noise, and a fall on its upper bound alone, not the long
window's, which still holds the old regime; either is confirmed for
``change_confirm_s`` instead of ``up_confirm_s`` / ``down_confirm_s``.
Why: through TorchServe, a step from 2 to 14 req/s was flagged 0.7 s after
it began, but the rule above waited for the lower bound of a window to
clear the crossover, which the 2 s window's noise at 14/s never did and the
6 s window did after 6 s; the fat worker's queue grew meanwhile, and the
step's mean latency came out worse than either static setting's.  Only a
step: the detector is tuned for 2×, so a slow ramp trips it too, and acting
on those moved a ramp's swap early, then twice.

A move grown on a detected step in expectation is also *weighed* in
expectation (the worth-it test below, over the same noisy rate), not on the
rate as measured.  Why: the two gates disagreed.  On the bench's step (2 to
14.3 req/s) the new regime's rate read 9-12 req/s in its first second in
some draws; in expectation over that noise the split was already the better
bet (the fat worker's queue grows without bound past its capacity), but at
the rate as read the fat worker was predicted faster, so the swap waited
until the measured rate cleared the crossover: 0.5-6.0 s after the step in
the queue model, 8 of 24 seeds past 2 s, against the alarm's tick in 19 of
24 (tests/unit/test_policy_sim.py).

A closed loop (N clients, each waiting for its answer) sends only as fast
as answers come, so its rate says little; its load is the depth it keeps in
the system, Packrat's own B.  When a queue persists beyond what the
current level's workers take (the least depth over the long window exceeds
its B; ignored while the queue drains and for ``depth_settle_s`` after a
swap), the policy moves up to the level that serves that many requests in
flight fastest, when it is faster than the current one by ``min_gain``
(``closed_loop_target``; the optimizer's own objective for B).  The rate
model is not asked: in a closed loop the rate is the current level's real
throughput, and a profile that overrates the current level reads it as a
load the level keeps up with.  An open loop's queue that only lingers after
a swap or a peak drains, so it shows no such depth.

A safety net covers a profile that is too optimistic: if the queue keeps
growing (beyond its Poisson wander, over the long window) while the policy
believes the current level keeps up, the current level is treated as
overloaded.  A *growing* queue, not a long one: the
backlog a swap leaves behind shrinks, and must not trigger another swap.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from packrat_plugin.calibration import Calibration
from packrat_plugin.levels import Level, worker_class
from packrat_plugin.plan_types import PlanItem

UP_RULES = ("bound", "expected")


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of the policy; every one is a ``packrat serve`` flag."""

    up_confirm_s: float = 0.5
    down_confirm_s: float = 3.0
    confirm_grace_s: float = 0.5  # a gap this short does not restart a confirmation
    noise_z: float = 2.0  # width of the Poisson confidence bound that gates shrinking
    up_z: float = 2.0  # ... and growing
    up_rule: str = "bound"  # or "expected": a new split of the cores may also grow on expected latency
    depth_settle_s: float = 6.0  # after a swap, queue-depth rules wait this long (one long window)
    min_gain: float = 0.10  # relative latency improvement a move must promise
    horizon_s: float = 30.0  # expected time at a load, until swaps measure it
    min_horizon_s: float = 10.0
    warm_swap_s: float = 1.0  # time to serve after a warm swap, until measured
    cold_swap_s: float = 8.0  # ... after a cold one
    warm_interference: float = 0.1  # κ: share of serving speed a swap takes
    cold_interference: float = 1.0
    learning_rate: float = 0.5  # EWMA weight of a new measurement
    # After a change the detector flagged: a rise to another split of the cores may also grow on the new regime's
    # rate (since the change point) in expectation; a fall reads the new regime alone (its upper bound at
    # ``noise_z``), not the long window that still holds the old one; either is confirmed for
    # ``change_confirm_s`` (0: acted on at the tick that wants it; the detector's alarm is itself a sequential
    # test at a chosen false-alarm rate, and a confirmation cost one or two 0.25 s ticks of a step's backlog).
    # False: the windows' bounds and timers only, as before the detector.
    # Only a change of at least ``step_ratio`` (either way) counts as a step: a slow ramp also trips the
    # detector (it is tuned for 2×), and acting on those moved a ramp's swap early, then twice.
    act_on_changes: bool = True
    change_confirm_s: float = 0.0
    step_ratio: float = 3.0
    # The regime's rate (arrivals since the last alarm) joins the windows once it spans this long: its bounds
    # then gate growing and shrinking with the windows', and a move to another split of the cores may grow on it
    # in expectation.  0: never.
    regime_min_s: float = 15.0

    def __post_init__(self) -> None:
        if self.up_confirm_s < 0 or self.down_confirm_s < 0:
            raise ValueError("confirm times must be non-negative")
        if self.noise_z < 0 or self.up_z < 0:
            raise ValueError(f"noise_z and up_z must be non-negative, got {self.noise_z}, {self.up_z}")
        if not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if self.horizon_s <= 0 or self.min_horizon_s <= 0:
            raise ValueError("horizons must be positive")
        if self.up_rule not in UP_RULES:
            raise ValueError(f"up_rule must be one of {', '.join(UP_RULES)}, got {self.up_rule!r}")
        if self.warm_swap_s < 0 or self.cold_swap_s < 0:
            raise ValueError("swap times must be non-negative")
        if not 0.0 < self.learning_rate <= 1.0:
            raise ValueError(f"learning_rate must be in (0, 1], got {self.learning_rate}")
        if self.regime_min_s < 0:
            raise ValueError(f"regime_min_s must be ≥ 0, got {self.regime_min_s}")
        if not self.step_ratio >= 1.0 or self.change_confirm_s < 0:
            raise ValueError(f"step_ratio must be ≥ 1 and change_confirm_s ≥ 0, got {self.step_ratio}, "
                             f"{self.change_confirm_s}")  # fmt: skip


@dataclass(frozen=True)
class Observation:
    """What the controller measured at one tick."""

    now: float  # seconds, monotonic
    rate_short: float  # arrivals/s over the short window
    rate_long: float  # arrivals/s over the long window
    short_span_s: float = 2.0  # seconds the short rate was measured over
    long_span_s: float = 6.0
    backlog_growing: bool = False  # queue grew beyond its noise over the long window
    concurrency: float = 0.0  # requests persistently in the system (0 while a backlog drains)
    # +1 / -1: the change detector flagged a rise / fall of the arrival rate, and the new regime is younger
    # than the long window (so ``rate_short`` is the new regime's rate alone, over ``short_span_s``); 0: none.
    change: int = 0
    change_ratio: float = 1.0  # the flagged change's new rate over its old one
    # Arrivals/s since the detector's last alarm (at most the monitor's regime window back), and over how long:
    # under a load that holds, the tightest reading of its rate (load_monitor.py).  0 s: none.
    rate_regime: float = 0.0
    regime_span_s: float = 0.0
    # The most requests in the system at any sample of the short window (inf: not measured).
    peak_depth: float = math.inf

    def bounds(self, rate: float, span_s: float, z: float) -> tuple[float, float]:
        """Poisson confidence bounds of a rate measured as ``rate·span`` arrivals."""
        if span_s <= 0:
            return 0.0, math.inf
        n = rate * span_s
        spread = z * math.sqrt(max(n, 1.0))
        return max(0.0, n - spread) / span_s, (n + spread) / span_s


@dataclass(frozen=True)
class Decision:
    """A move the policy wants now, with the numbers that justified it."""

    target: Level
    rate: float
    reason: str
    predicted_now_s: float
    predicted_new_s: float
    warm: bool

    def to_dict(self) -> dict[str, object]:
        def finite(x: float) -> float | None:
            return round(x, 4) if math.isfinite(x) else None

        return {
            "target_batch": self.target.batch,
            "rate": round(self.rate, 3),
            "reason": self.reason,
            "predicted_now_s": finite(self.predicted_now_s),
            "predicted_new_s": finite(self.predicted_new_s),
            "warm": self.warm,
        }


@dataclass
class SwapCosts:
    """What swaps have cost, learned from the swapper's phase timings."""

    warm_s: float
    cold_s: float
    horizon_s: float
    rate: float
    last_swap_at: float | None = None

    def record_swap(self, now: float, serving_after_s: float, warm: bool, min_horizon_s: float) -> None:
        if warm:
            self.warm_s += self.rate * (serving_after_s - self.warm_s)
        else:
            self.cold_s += self.rate * (serving_after_s - self.cold_s)
        if self.last_swap_at is not None:
            dwell = max(min_horizon_s, now - self.last_swap_at)
            self.horizon_s += self.rate * (dwell - self.horizon_s)
        self.last_swap_at = now


@dataclass
class ReconfigurationPolicy:
    """Chooses the level to serve; see the module docstring for the rules."""

    levels: list[Level]
    config: PolicyConfig = field(default_factory=PolicyConfig)
    _direction: int = 0
    _since: float = 0.0
    _last_wanted: float = -math.inf
    _depth_quiet_until: float = -math.inf
    _last_swap_at: float = -math.inf
    costs: SwapCosts = field(init=False)

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("the policy needs at least one level")
        self.levels = sorted(self.levels, key=lambda lv: lv.batch)
        cfg = self.config
        self.costs = SwapCosts(cfg.warm_swap_s, cfg.cold_swap_s, cfg.horizon_s, cfg.learning_rate)

    def calibrate(self, calibration: Calibration) -> None:
        """Predict with what serving has been measured to cost (calibration.py)."""
        self.levels = [dataclasses.replace(lv, calibration=calibration) for lv in self.levels]

    def level(self, batch: int) -> Level:
        for lv in self.levels:
            if lv.batch == batch:
                return lv
        raise KeyError(f"no level for B={batch}; levels are {[lv.batch for lv in self.levels]}")

    def best(self, rate: float) -> Level:
        """The level with the lowest predicted latency at ``rate`` (the smaller B on a tie).

        Past every level's capacity, the one with the most capacity: its queue
        grows slowest.
        """
        finite = [lv for lv in self.levels if math.isfinite(lv.predicted_latency_s(rate))]
        if not finite:
            return max(self.levels, key=lambda lv: (lv.capacity, -lv.batch))
        return min(finite, key=lambda lv: (lv.predicted_latency_s(rate), lv.batch))

    def growing_target(self, rate: float, span_s: float, high: float) -> Level:
        """The level to grow to at a rate measured as ``rate·span_s`` arrivals,
        ``high`` its upper bound: :meth:`best` at ``high``, unless a smaller
        level is better by ``min_gain`` in expectation over the rate's noise.

        Choosing at the upper bound keeps one move per change of load: a
        target that copes with the high end is not left behind by the next
        burst.  But on many cores the level that copes best with the high end
        (8×⟨2,1⟩ of 16 cores, by its capacity) can be much slower per request
        than one that copes with all but the tail (2×⟨8,1⟩); growing to it
        overshot, and either stayed or came back.  In expectation a level the
        tail would overload still pays for the backlog it would build
        (:meth:`Level.latency_within_s`), so the smaller one wins only where
        it keeps up.
        """
        robust = self.best(high)
        h = self.costs.horizon_s
        smaller = [lv for lv in self.levels if lv.batch < robust.batch]
        if not smaller:
            return robust
        lighter = min(smaller, key=lambda lv: (lv.expected_latency_s(rate, span_s, h), lv.batch))
        return lighter if self._better_in_expectation(lighter, robust, rate, span_s) else robust

    def record_swap(self, now: float, serving_after_s: float, warm: bool) -> None:
        self.costs.record_swap(now, serving_after_s, warm, self.config.min_horizon_s)
        self._direction, self._last_wanted = 0, -math.inf
        # While the old set drains it shares the cores with the new one, so the
        # queue can grow for a while after a swap: the swap's own after-effect,
        # not load.  The depth-based rules wait for a clean window.
        self._depth_quiet_until = now + self.config.depth_settle_s
        self._last_swap_at = now

    def observe(self, obs: Observation, current: int, warm: set[int] | frozenset[int] = frozenset()) -> Decision | None:
        """The move to make now, if any.  ``warm``: levels whose workers already run."""
        cur = self.level(current)
        candidate, rate, reason, evidence_span_s = self._candidate(obs, cur)
        direction = 0 if candidate is None else (1 if candidate.batch > cur.batch else -1)
        if direction == 0:
            if obs.now - self._last_wanted > self.config.confirm_grace_s:
                self._direction = 0
            return None
        if direction != self._direction:
            self._direction, self._since = direction, obs.now
        self._last_wanted = obs.now
        confirm = self.config.up_confirm_s if direction > 0 else self.config.down_confirm_s
        if self._detected(obs) == direction:
            confirm = self.config.change_confirm_s
        if obs.now - self._since < confirm:
            return None
        is_warm = candidate.batch in warm
        if reason == "requests in flight rose":
            # A closed loop: Packrat's plan for B in flight; the rate model does not apply.
            n = obs.concurrency
            return Decision(candidate, rate, reason, cur.closed_loop_latency_s(n), candidate.closed_loop_latency_s(n),
                            is_warm)  # fmt: skip
        if evidence_span_s > 0:
            # Grown in expectation over the new regime's noisy rate: weigh the swap on the same evidence.
            h = self.costs.horizon_s
            w_now = cur.expected_latency_s(rate, evidence_span_s, h)
            w_new = candidate.expected_latency_s(rate, evidence_span_s, h)
        else:
            w_now = math.inf if reason == "backlog growing" else cur.predicted_latency_s(rate)
            w_new = candidate.predicted_latency_s(rate)
        if not self._worth_it(rate, w_now, w_new, cur, candidate, is_warm):
            return None
        return Decision(candidate, rate, reason, w_now, w_new, is_warm)

    # -- rules -------------------------------------------------------------------

    def _clearly_better(self, new: Level, cur: Level, rate: float) -> bool:
        w_cur, w_new = cur.predicted_latency_s(rate), new.predicted_latency_s(rate)
        if not math.isfinite(w_cur):
            return math.isfinite(w_new) or new.capacity > cur.capacity
        return w_new < w_cur * (1.0 - self.config.min_gain)

    def _detected(self, obs: Observation) -> int:
        """The direction of a step the detector flagged (0 if none, if it was smaller than ``step_ratio``, or if
        the policy is not to act on changes)."""
        if not self.config.act_on_changes or obs.change == 0:
            return 0
        if self._last_swap_at >= obs.now - obs.regime_span_s:
            return 0  # this step was acted on (the regime's span runs from its alarm): further moves by the rules
        ratio = obs.change_ratio if obs.change > 0 else 1.0 / max(obs.change_ratio, 1e-9)
        return obs.change if ratio >= self.config.step_ratio else 0

    def _wants_up(self, up: Level, cur: Level, obs: Observation, rate_low: float) -> float | None:
        """Growing: at the low end of the rate's noise, the target beats the current level;
        a move to another split of the cores also in expectation over the noise of the
        new regime's rate after a rise the detector flagged, or (``up_rule="expected"``)
        over the long window's.

        None: not wanted.  Otherwise the span of the short window when the move rests on a
        detected step in expectation (the worth-it test then weighs the swap in expectation
        over the same noisy rate), else 0 (the worth-it test reads the measured rate as is).
        """
        if self._clearly_better(up, cur, rate_low):
            return 0.0
        if worker_class(up) == worker_class(cur):
            return None  # between batch caps of one split: the model credits a larger cap for free
        if self._detected(obs) > 0 and self._better_in_expectation(up, cur, obs.rate_short, obs.short_span_s):
            return obs.short_span_s
        if self._regime_known(obs) and self._better_in_expectation(up, cur, obs.rate_regime, obs.regime_span_s):
            return 0.0
        if self.config.up_rule == "bound":
            return None
        return 0.0 if self._better_in_expectation(up, cur, obs.rate_long, obs.long_span_s) else None

    def _regime_known(self, obs: Observation) -> bool:
        """Whether the regime's rate is measured over long enough to be read (``regime_min_s``)."""
        return self.config.regime_min_s > 0 and obs.regime_span_s >= self.config.regime_min_s

    def _better_in_expectation(self, new: Level, ref: Level, rate: float, span_s: float) -> bool:
        """:meth:`_clearly_better` averaged over what a rate measured as ``rate·span_s`` arrivals may be."""
        h = self.costs.horizon_s
        return new.expected_latency_s(rate, span_s, h) < ref.expected_latency_s(rate, span_s, h) * (
            1.0 - self.config.min_gain
        )

    @staticmethod
    def _no_worse(new: Level, ref: Level, rate: float) -> bool:
        w_new, w_ref = new.predicted_latency_s(rate), ref.predicted_latency_s(rate)
        if math.isinf(w_new) and math.isinf(w_ref):
            return new.capacity >= ref.capacity
        return w_new <= w_ref

    def best_closed_loop(self, in_flight: float) -> Level:
        """The level that serves ``in_flight`` requests always in the system fastest (the smaller B on a tie)."""
        return min(self.levels, key=lambda lv: (lv.closed_loop_latency_s(in_flight), lv.batch))

    def closed_loop_target(self, in_flight: float, cur: Level) -> Level | None:
        """The level that serves ``in_flight`` requests fastest (:meth:`Level.closed_loop_latency_s`), when
        a queue was held beyond what the current level's workers take (``in_flight > B``) and that level is
        larger and faster than the current one by ``min_gain``; else None.

        Why not the rate model here: in a closed loop the clients send only as fast as answers come, so the
        arrival rate is the current level's real throughput, and a profile that credits the current level
        with more than TorchServe serves on this machine reads that rate as a load it keeps up with.  Measured
        on a 2-vCPU EPYC: the fat worker's profile said 13 requests/s, TorchServe served 9 at 8 in flight,
        and the rate model kept it there while the split served the same 8 clients 1.16× faster.  The
        requests in the system do not depend on that credit.
        """
        if in_flight <= cur.batch:
            return None
        best = self.best_closed_loop(in_flight)
        if best.batch <= cur.batch:
            return None
        gain = best.closed_loop_latency_s(in_flight) < cur.closed_loop_latency_s(in_flight) * (1 - self.config.min_gain)
        return best if gain else None

    def floor_level(self, concurrency: float) -> Level:
        """The largest level whose B the persistent concurrency fills."""
        fitting = [lv for lv in self.levels if lv.batch <= max(1.0, concurrency)]
        return fitting[-1] if fitting else self.levels[0]

    def _candidate(self, obs: Observation, cur: Level) -> tuple[Level | None, float, str, float]:
        """The level the rules want, the rate they read, why, and the span over which a detected step's
        rate was weighed in expectation (0: the rate as measured)."""
        z = self.config.noise_z
        rate = obs.rate_short
        # The short window catches a step within ~2 s; the long one, three
        # times the arrivals and so a bound √3 tighter, catches a slow rise
        # (a diurnal ramp) that the short one's noise would hide until late.
        rate_low = max(obs.bounds(obs.rate_short, obs.short_span_s, self.config.up_z)[0],
                        obs.bounds(obs.rate_long, obs.long_span_s, self.config.up_z)[0])  # fmt: skip
        _, short_high = obs.bounds(obs.rate_short, obs.short_span_s, z)
        _, long_high = obs.bounds(obs.rate_long, obs.long_span_s, z)
        regime_high = 0.0
        if self._regime_known(obs):
            # A load that holds: its regime's many arrivals bound the rate tightly from both sides.
            rate_low = max(rate_low, obs.bounds(obs.rate_regime, obs.regime_span_s, self.config.up_z)[0])
            regime_high = obs.bounds(obs.rate_regime, obs.regime_span_s, z)[1]
        detected = self._detected(obs)
        if obs.now < self._depth_quiet_until:
            obs = dataclasses.replace(obs, backlog_growing=False, concurrency=0.0)
        floor = self.floor_level(obs.concurrency)
        up = self.growing_target(rate, obs.short_span_s, short_high)
        # Growing on the rate needs a request that waited: with no more requests in the system than the current
        # level's workers take, nobody queued, whatever the rate says.  One client sending back to back reads
        # as the fat worker's whole capacity (16/s at 58 ms a request), and moved it to two slower workers.
        waited = obs.peak_depth > cur.batch
        evidence_span_s = self._wants_up(up, cur, obs, rate_low) if up.batch > cur.batch and waited else None
        if evidence_span_s is not None:
            # The larger of the two, unless the rate model calls the floor worse.
            target = floor if floor.batch > up.batch and self._no_worse(floor, up, short_high) else up
            return target, rate, "load rose", evidence_span_s
        # A queue held through the whole long window: the requests in the
        # system are the load (Packrat's B), whatever the rate reads.
        closed = self.closed_loop_target(obs.concurrency, cur)
        if closed is not None:
            return closed, rate, "requests in flight rose", 0.0
        if obs.backlog_growing:
            bigger = [lv for lv in self.levels if lv.capacity > cur.capacity]
            if bigger:
                nearest = min(bigger, key=lambda lv: lv.batch)
                return max(nearest, up, key=lambda lv: lv.batch), rate, "backlog growing", 0.0
            return None, rate, "", 0.0
        # Shrinking: even at the high end of both windows, a smaller level is clearly better.  After a
        # fall the detector flagged, the long window still holds the old regime: the new one's alone.
        # Under a load that holds, a dip of both windows is not a fall while the regime's upper bound disagrees.
        high = short_high if detected < 0 else max(short_high, long_high, regime_high)
        down = max(self.best(high), floor, key=lambda lv: lv.batch)
        if down.batch < cur.batch and self._clearly_better(down, cur, high):
            return down, rate, "load fell", 0.0
        return None, rate, "", 0.0

    def _worth_it(self, rate: float, w_now: float, w_new: float, cur: Level, new: Level, warm: bool) -> bool:
        if not math.isfinite(w_now):
            # Overloaded now: any level that keeps up, or has more capacity, is better.
            return math.isfinite(w_new) or new.capacity > cur.capacity
        if not math.isfinite(w_new) or w_new >= w_now:
            return False
        swap_s = self.costs.warm_s if warm else self.costs.cold_s
        kappa = self.config.warm_interference if warm else self.config.cold_interference
        saved = rate * (w_now - w_new) * max(0.0, self.costs.horizon_s - swap_s)
        cost = rate * swap_s * w_now * kappa
        return saved > cost


def standby_items(levels: list[Level], current: int, budget_workers: int,
                  first: list[Level] | tuple[Level, ...] = ()) -> list[PlanItem]:  # fmt: skip
    """The worker classes to keep warm beside the active one: ``first`` (the moves a detected rise or fall would
    make: ``prepared_moves``), then the nearest levels.

    Levels are visited outwards from ``current``, the next larger before the
    next smaller (a rising load hurts more than a falling one), and each new
    class is kept if its workers still fit ``budget_workers``.
    """
    ordered = sorted(levels, key=lambda lv: lv.batch)
    index = next(i for i, lv in enumerate(ordered) if lv.batch == current)
    active = ordered[index].plan.instances[0]
    seen = {(active.threads, active.batch)}
    chosen: list[PlanItem] = []
    used = 0
    nearest = [ordered[j] for d in range(1, len(ordered)) for j in (index + d, index - d) if 0 <= j < len(ordered)]
    for level in (*first, *nearest):
        item = level.plan.instances[0]
        if (item.threads, item.batch) in seen:
            continue
        seen.add((item.threads, item.batch))
        if used + item.count <= budget_workers:
            chosen.append(item)
            used += item.count
    return chosen


def prepared_moves(policy: ReconfigurationPolicy, current: int, rate: float, ratio: float) -> dict[str, Level]:
    """The levels the next rise and the next fall would move to: the best level at the rate times (or over)
    ``ratio``, the smallest change the detector is tuned for, or further out until the best level is another
    one (at idle a doubled rate is still idle).  These passive sets are worth keeping warm before any other."""
    top = 2.0 * max(lv.capacity for lv in policy.levels)
    out = {}
    for name, factor in (("rise", ratio), ("fall", 1.0 / ratio)):
        probe = max(rate, 0.05 * top) * factor if name == "rise" else rate * factor
        while 1e-3 < probe < top:
            level = policy.best(probe)
            if level.batch != current:
                out[name] = level
                break
            probe *= factor
    return out
