"""Typed, checked policy parameters: each policy declares a :class:`PolicyParams` model.

``--policy-arg NAME.FIELD=VALUE`` (``SchedulerConfig.policy_args``) is parsed here into one model
per policy named in ``--batching``. An unknown policy, a policy that is not in ``--batching``, an
unknown parameter or a value out of range is a :class:`~tidal.config.ConfigError` with one line
naming it, raised when the policy is built, which every entry point does before loading weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from tidal.config import ConfigError

P = TypeVar("P", bound="PolicyParams")


class PolicyParams(BaseModel):
    """Base of every policy's parameters: frozen, no unknown fields, strings from the CLI coerced."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class NoParams(PolicyParams):
    """A policy without parameters."""


def _describe(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def parse_params(cls: type[P], policy: str, raw: Mapping[str, Any]) -> P:
    """``cls`` from ``raw`` (field -> value), or a one-line ConfigError naming the parameter."""
    try:
        return cls(**raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else ""
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted(cls.model_fields)) or "no parameters"
            raise ConfigError(f"policy argument {policy}.{field}: unknown parameter of {policy!r} "
                              f"(it takes: {known})") from None
        shown = f"={_describe(raw[field])}" if field in raw else ""
        msg = err["msg"][0].lower() + err["msg"][1:]
        raise ConfigError(f"policy argument {policy}.{field}{shown}: {msg}") from None


def split_policy_args(policy_args: Mapping[str, Any], names: list[str], known: set[str]) -> dict[str, dict[str, Any]]:
    """Group ``{"sla.alpha": 4, ...}`` by policy; each key must name a policy of ``names``."""
    out: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, value in policy_args.items():
        policy, dot, field = key.partition(".")
        if not dot or not field:
            raise ConfigError(f"policy argument {key!r}: expected POLICY.PARAMETER=VALUE, e.g. sla.alpha=4")
        if policy not in known:
            raise ConfigError(f"policy argument {key}: unknown policy {policy!r}; "
                              f"available: {', '.join(sorted(known))}")
        if policy not in out:
            raise ConfigError(f"policy argument {key}: policy {policy!r} is not in batching "
                              f"{'+'.join(names)!r}")
        out[policy][field] = value
    return out


__all__ = ["NoParams", "PolicyParams", "parse_params", "split_policy_args"]
