"""Putting a run together: its parts, with the options its settings ask for."""
