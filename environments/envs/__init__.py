"""Environments shipped with Lachesis."""
