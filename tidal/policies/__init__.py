"""Pure scheduling policies and their registry (see ``registry.py``)."""

from tidal.policies.registry import available_policies, build_policy, register_policy

__all__ = ["available_policies", "build_policy", "register_policy"]
