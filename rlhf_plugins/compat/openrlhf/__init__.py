"""Stands in for OpenRLHF's package while an agent file written for OpenRLHF is imported without
OpenRLHF installed; only ``openrlhf.utils.agent`` is provided."""
