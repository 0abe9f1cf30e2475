"""Placement strategies: where each role of the loop lives."""
