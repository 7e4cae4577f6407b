"""Reporting shared by every command that measures: the machine a result came from, progress
bars, JSON results with PNG plots beside them. No torch (it is described only when loaded)."""
