"""Scripted evaluations (`clusterkv eval ...`)."""
