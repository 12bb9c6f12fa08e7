"""E2's cost model per engine (issue 63): fixed, or learnt online from each engine's pass
reports (``calibration.py``) from the prior that suits it (``cost_priors.py``).

The router calls ``calibrate`` with each health probe's answer on its probe thread, and
the simulator with each report: the fit runs there, never on a request's path, and E2
swaps the engine's model in one assignment. ``cost_fits`` says, per engine, what it is
priced with and why.

An engine that has not learnt its own fit yet is priced with the learnt fit of a peer that
serves the same model on the same device (``cost_facts`` equal), where one has: a prior
10x off priced the engines still at it 10x apart from their learnt peers, so E2 sent them
nothing and they learnt nothing (tiny engines from SmolLM2's prior, programming: one of four
engines still at its prior after 270 requests).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from preble_backend.common.cost_model import CostModel
from scheduler.calibration import CostFit, OnlineCost
from scheduler.cost_priors import Prior, matches, mismatch_message, parse_setting, prior_for

log = logging.getLogger("preble.e2")
UNKNOWN = "tiny_cpu"  # what an auto-calibrating E2 prices an engine with before it first reports
REPRICE = 0.02  # a fit that moves no prefill's price by more leaves the load as it was priced


class Calibrated:
    """Mixed into E2: ``costs[i]`` is what engine ``i`` is priced with."""

    costs: list[CostModel]

    def _init_costs(self, num_instances: int, cost_model: CostModel | list[CostModel] | str, calibrate: bool,
                    window_passes: float) -> None:  # fmt: skip
        """``cost_model``: a fit (fixed, unless ``calibrate``: then the prior of every
        engine), one per engine (fixed: the simulator's truth), or a setting
        (``cost_priors.parse_setting``)."""
        per_engine = list(cost_model) if isinstance(cost_model, list) else None
        if per_engine is not None:
            cost_model = per_engine[0]
        self._object = cost_model if isinstance(cost_model, CostModel) else None
        if self._object is not None:
            self._named, self._given = None, self._object
        else:
            auto, self._named = parse_setting(cost_model)
            calibrate = calibrate or auto
            self._given = CostModel.load(self._named or UNKNOWN)
        self.calibrating, self.window_passes = calibrate, window_passes
        self.costs = per_engine or [self._given] * num_instances
        self.shadow: list[CostModel] | None = None  # the simulator's true costs, to compare decisions
        self.agreement: list[tuple[int, bool]] = []  # (decision, same choice as under ``shadow``)
        label = self._named or self._given.source or "the given fit"
        status = "prior" if calibrate else "fixed"
        self._first = CostFit(self._given, status, label, "unknown", "the engine has not said what it serves")
        self.fits: list[CostFit] = [self._first] * num_instances
        self.online: list[OnlineCost | None] = [None] * num_instances
        self.facts: list[tuple | None] = [None] * num_instances  # what each engine serves: its peers
        self.repricing: set[int] = set()  # instances whose fit moved: E2 reprices their load
        self.priced_with = list(self.costs)  # the fit each instance's load was last priced with

    @property
    def cost(self) -> CostModel:
        """The fit E2 was given (the hand-computed tests' single model)."""
        return self._given

    def _grow_costs(self) -> None:
        self.costs.append(self._given)
        self.priced_with.append(self._given)
        self.fits.append(self._first)
        self.online.append(None)
        self.facts.append(None)

    def calibrate(self, instance: int, load: dict) -> bool:
        """An engine's report: what it serves (``cost_facts``, once: the prior) and what its
        passes cost (``pass_costs``). True when its fit, or a peer's it borrows, changed."""
        facts, started = load.get("cost_facts"), False
        if facts and self.online[instance] is None and self.fits[instance] is self._first:
            self._start(instance, facts)
            started = True
        online, passes = self.online[instance], load.get("pass_costs")
        refit = online is not None and bool(passes) and online.observe(passes)
        if online is None or not (started or refit):
            return started
        was = self.fits[instance]
        for i in self._peers(instance) if refit else [instance]:
            self._settle(i)
        fit = self.fits[instance]
        if was.status != fit.status:
            why = fit.model.source if fit.status == "learnt" else fit.reason
            log.info("instance %d is priced with %s: %s", instance, fit.status, why)
        return True

    def _peers(self, instance: int) -> list[int]:
        """The calibrating engines that serve what ``instance`` serves, itself first."""
        key = self.facts[instance]
        return [instance] + [i for i, f in enumerate(self.facts) if i != instance and f == key]

    def _settle(self, instance: int) -> None:
        """Price the engine with its own fit once learnt, else with its peers' most practised
        learnt fit where one has (``CostFit.status`` "peer"), else its prior."""
        own = self.online[instance].fit
        fit = own
        if own.status != "learnt":
            learnt = [i for i in self._peers(instance)[1:] if self.online[i].fit.status == "learnt"]
            if learnt:
                peer = max(learnt, key=lambda i: self.online[i].fit.passes)
                why = f"instance {peer}'s learnt fit, the same model and device ({own.reason})"
                fit = replace(own, model=self.online[peer].fit.model, status="peer", reason=why)
        self.fits[instance], self.costs[instance] = fit, fit.model
        self._note_price(instance)

    def _note_price(self, instance: int) -> None:
        """E2 reprices the instance's load where its fit moved since it was last priced."""
        if moved(self.priced_with[instance], self.costs[instance]):
            self.repricing.add(instance)

    def _start(self, instance: int, facts: dict) -> None:
        prior = self._prior(facts)
        if self.calibrating:
            self.online[instance] = OnlineCost(prior, self.window_passes)
            self.facts[instance] = tuple(sorted(facts.items()))
            self.fits[instance] = self.online[instance].fit
            self.costs[instance] = prior.model
        else:  # fixed: say whether it suits the engine
            own = self._named is not None and facts.get("emulated") == self._named  # waited out k x slower
            self.costs[instance] = prior.model if own else self._given
            self.fits[instance] = CostFit(self.costs[instance], "fixed", prior.label, prior.kind)
        self._note_price(instance)  # requests routed before its first report
        if prior.kind == "mismatch":
            log.warning("instance %d: %s", instance, mismatch_message(prior, facts, not self.calibrating))
        else:
            log.info("instance %d starts from %s", instance, prior.label)

    def _prior(self, facts: dict) -> Prior:
        """The fit named, or given, else the best this router has for the engine."""
        if self._named is not None or self._object is None:
            return prior_for(facts, self._named)
        kind = "matches" if matches(self._object, facts) else "mismatch"
        return Prior(self._object, self._object.source or "the given fit", kind)

    def _agrees(self, choice: int, candidates, rank) -> None:
        """With ``shadow`` set: whether the choice is one the true costs would make on the
        same state: its true cost within a rounding of the best (``rank(i)``: a candidate's
        sort key, its cost first, read under ``costs``). Candidates whose costs tie are all
        right: float noise, not the fit, picks among them."""
        if self.shadow is None:
            return
        mine, self.costs = self.costs, self.shadow
        try:
            best, chosen = min(rank(i)[0] for i in candidates), rank(choice)[0]
        finally:
            self.costs = mine
        self.agreement.append((self._decisions, chosen <= best + 1e-6 * max(1.0, abs(best))))

    def cost_fits(self) -> list[CostFit]:
        return list(self.fits)


def moved(old: CostModel, new: CostModel) -> bool:
    """Whether a prefill of 32, 512 or 4,096 tokens, or a load-back of 1,024, is priced
    more than ``REPRICE`` apart by the two fits: repricing a load walks every request in
    the window (~1 µs each, 20 ms for 10,000), so a refit that moves nothing skips it, and
    small moves add up against the fit the load was priced with."""
    pairs = [(old.prefill_time(n), new.prefill_time(n)) for n in (32, 512, 4096)]
    pairs.append((old.load_time(1024), new.load_time(1024)))
    return any(abs(b - a) > REPRICE * max(a, b) for a, b in pairs)
