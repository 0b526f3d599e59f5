"""Scheduler service: the global waiting queue, worker accounting and dispatch."""
