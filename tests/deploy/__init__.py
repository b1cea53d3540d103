"""Deployment: docker compose, haproxy, prometheus, kubectl."""
