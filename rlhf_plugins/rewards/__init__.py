"""Rewards: adapters for reward callables written for TRL or OpenRLHF."""
