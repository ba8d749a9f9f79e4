"""Cluster controller (TPU node groups, cache objects, admission webhooks). Built in a later wave."""
