"""Interpreters that run a Schedule on real hardware."""
