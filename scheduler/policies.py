"""Every policy by name, and building one from what the router or the simulator knows.

A policy's own tunables are keyword arguments of its constructor; a name it does not take
is refused. The cluster facts (``CLUSTER_FACTS``: the clock, the engines' page size, the
cost model, the KV capacity, the operator's TPOT SLO) are offered to every policy and taken
by those that use them.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.policy import Policy

# Each policy's name and where its class is, imported when one is built: listing the names
# (the CLI's help, a configuration's check) imports no policy, nor numpy under them.
POLICIES: dict[str, str] = {
    "e2": "scheduler.disagg:E2PD",  # E2, and prefill/decode disaggregation where engines have roles
    "round_robin": "scheduler.policy:RoundRobin",
    "least_load": "scheduler.policy:LeastLoad",
    "prefix_hash": "scheduler.baselines:PrefixHash",
    "cache_aware": "scheduler.baselines:CacheAware",
    "kv_cost": "scheduler.baselines:KVCost",
    # the anchors' prefill/decode rules: their aggregated router where no engine has a role
    "dynamo_pd": "scheduler.disagg_baselines:DynamoPD",
    "llmd_pd": "scheduler.disagg_baselines:LlmdPD",
    "sglang_pd": "scheduler.disagg_baselines:SGLangPD",
}
PD_RULES = ("dynamo_pd", "llmd_pd", "sglang_pd")
ALL_POLICIES = tuple(p for p in POLICIES if p not in PD_RULES)  # E2 first, then the aggregated baselines
CLUSTER_FACTS = ("clock", "page_size", "cost_model", "capacity_tokens", "tpot_slo_ms", "ttft_slo_ms")


def policy_class(name: str) -> type[Policy]:
    module, _, cls = POLICIES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def _keywords(name: str) -> list[str]:
    """The constructor's keywords, and its base class's where it passes ``**options`` on."""
    keywords: list[str] = []
    for cls in policy_class(name).__mro__:
        params = inspect.signature(cls.__init__).parameters.values()
        keywords += [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                     and p.name not in ("self", "num_instances", *keywords)]  # fmt: skip
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            return keywords
    return keywords


def policy_options(name: str) -> list[str]:
    """The tunables a policy takes (its constructor's keywords, less the cluster facts)."""
    return [p for p in _keywords(name) if p not in CLUSTER_FACTS]


def make_policy(name: str, num_instances: int, facts: dict | None = None, **options) -> Policy:
    """Build policy ``name`` for ``num_instances`` instances with its own ``options``;
    each of ``facts`` (keys from ``CLUSTER_FACTS``) goes to it if it takes it."""
    if name not in POLICIES:
        raise ValueError(f"policy={name!r} is invalid: expected one of {', '.join(POLICIES)}")
    accepted = policy_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"policy {name} takes no option(s) {', '.join(unknown)}; "
            f"its options: {', '.join(accepted) or 'none'}"
        )
    facts = facts or {}
    strange = sorted(set(facts) - set(CLUSTER_FACTS))
    if strange:
        raise ValueError(f"unknown cluster fact(s): {', '.join(strange)}")
    given = {k: v for k, v in facts.items() if k in _keywords(name)}
    return policy_class(name)(num_instances, **given, **options)
