"""Policy registry: a policy is added in one place, keyed by the name used in config and CLI.

``@register_policy("name", params=NameParams)`` on a factory ``(SchedulerConfig, NameParams) ->
SchedulingPolicy``. Names may be joined with ``+`` (``bucket+memory+sla``): the parts are combined
from their typed answers (:mod:`tidal.policies.compose`). :func:`build_policy` checks the names and
every ``--policy-arg`` before it builds anything; it is pure and cheap, so every entry point calls
it before loading weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.config import ConfigError, SchedulerConfig
from tidal.core.policy import SchedulingPolicy
from tidal.policies.params import NoParams, PolicyParams, parse_params, split_policy_args

PolicyFactory = Callable[[SchedulerConfig, Any], SchedulingPolicy]


@dataclass(frozen=True)
class _Entry:
    factory: PolicyFactory
    params: type[PolicyParams]


_REGISTRY: dict[str, _Entry] = {}


def register_policy(name: str, params: type[PolicyParams] = NoParams) -> Callable[[PolicyFactory], PolicyFactory]:
    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        _REGISTRY[name] = _Entry(factory, params)
        return factory
    return deco


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def policy_params(name: str) -> type[PolicyParams]:
    """The parameter model of a registered policy."""
    return _REGISTRY[name].params


def policy_names(config: SchedulerConfig) -> list[str]:
    """The policy names of ``config.batching``, checked (known, each once)."""
    names = [n.strip() for n in config.batching.split("+") if n.strip()]
    if not names:
        raise ConfigError("batching: no policy named")
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ConfigError(f"batching: unknown policy {unknown[0]!r}; available: {', '.join(available_policies())}")
    if len(set(names)) != len(names):
        raise ConfigError(f"batching: {config.batching!r} names a policy twice")
    return names


def build_policy(config: SchedulerConfig) -> SchedulingPolicy:
    """The policy ``config.batching`` names, with its parameters from ``config.policy_args``."""
    names = policy_names(config)
    raw = split_policy_args(config.policy_args, names, set(_REGISTRY))
    params = {n: parse_params(_REGISTRY[n].params, n, raw[n]) for n in names}
    parts = [_REGISTRY[n].factory(config, params[n]) for n in names]
    if len(parts) == 1:
        return parts[0]
    from tidal.policies.compose import CompositePolicy

    return CompositePolicy(parts)


def policy_args_for(batching: str, policy_args: dict[str, Any]) -> dict[str, Any]:
    """The arguments of ``policy_args`` that belong to the policies ``batching`` names (for commands
    that run several policies with one set of ``--policy-arg``)."""
    names = {n.strip() for n in batching.split("+")}
    return {k: v for k, v in policy_args.items() if k.partition(".")[0] in names}


def check_policy(config: SchedulerConfig) -> None:
    """Raise ConfigError naming what is wrong with ``--batching`` / ``--policy-arg``; build nothing lasting."""
    build_policy(config)


@register_policy("continuous")
def _continuous(config: SchedulerConfig, params: NoParams) -> SchedulingPolicy:
    return SchedulingPolicy()
