"""The real shell of many instances (worker processes or Ray actors, KV transport, failure
handling). Nothing is built here yet: today ``tidal serve`` runs one instance in one process."""
