"""Offline training of the three model families (``python -m model.train --config FILE``).

Imports ``model``; nothing in ``model`` or the service imports this package.
"""
