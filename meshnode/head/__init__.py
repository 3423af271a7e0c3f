"""The head: route planning and the distributed generation driver that :mod:`meshnode.api` serves."""
