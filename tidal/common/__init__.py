"""Plumbing shared by every command that measures or runs: the machine a result came from, progress
bars, JSON results with PNG plots beside them. No torch here (it is described only when loaded)."""
