"""Experiment configs: each module defines ``get_config(arg=None)`` returning a locked ConfigDict."""
