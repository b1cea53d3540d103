"""Deployment: topologies as data (configs/topologies/), the launcher, compose rendering."""
