"""Collective communication between pool ranks (see comm.py)."""
