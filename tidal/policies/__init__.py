"""Pure scheduling policies and their registry (see ``registry.py``).

Importing this package registers every policy: ``continuous`` (the baseline), ``static``,
``bucket`` (BucketServe), ``memory`` and ``sla`` (Pang et al.), ``slo-compose`` (DynaServe), and
``auto`` (each step's caps from whichever of the KV pool and the TBT SLO binds).
"""

from tidal.policies import auto, bucket, memory, sla, slo_compose, static  # noqa: F401  (registers them)
from tidal.policies.params import PolicyParams
from tidal.policies.registry import (
    available_policies,
    build_policy,
    check_policy,
    policy_args_for,
    policy_params,
    register_policy,
)

__all__ = ["PolicyParams", "available_policies", "build_policy", "check_policy", "policy_args_for", "policy_params",
           "register_policy"]
