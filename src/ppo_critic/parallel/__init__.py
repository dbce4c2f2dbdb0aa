"""Devices and process groups (the only place that decides where and with whom the critic runs)."""
