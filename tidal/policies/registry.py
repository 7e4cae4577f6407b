"""Policy registry: a policy is added in one place, keyed by the name used in config and CLI.

Names may be joined with ``+`` (``bucket+memory+sla``); each part contributes what it decides
and the rest falls back to the baseline (combination is done by config, not new classes).
"""

from __future__ import annotations

from collections.abc import Callable

from tidal.config import ConfigError, SchedulerConfig
from tidal.core.policy import SchedulingPolicy

PolicyFactory = Callable[[SchedulerConfig], SchedulingPolicy]
_REGISTRY: dict[str, PolicyFactory] = {}


def register_policy(name: str) -> Callable[[PolicyFactory], PolicyFactory]:
    def deco(factory: PolicyFactory) -> PolicyFactory:
        if name in _REGISTRY:
            raise ValueError(f"policy {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory
    return deco


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def build_policy(config: SchedulerConfig) -> SchedulingPolicy:
    names = [n.strip() for n in config.batching.split("+") if n.strip()]
    if not names:
        raise ConfigError("batching: no policy named")
    unknown = [n for n in names if n not in _REGISTRY]
    if unknown:
        raise ConfigError(f"batching: unknown policy {unknown[0]!r}; available: {', '.join(available_policies())}")
    if len(set(names)) != len(names):
        raise ConfigError(f"batching: {config.batching!r} names a policy twice")
    if len(names) == 1:
        return _REGISTRY[names[0]](config)
    from tidal.policies.compose import CompositePolicy

    return CompositePolicy([_REGISTRY[n](config) for n in names])


@register_policy("continuous")
def _continuous(config: SchedulerConfig) -> SchedulingPolicy:
    return SchedulingPolicy()
