"""Helpers of tests/unit/test_connector_layerwise.py that other tests use too (moved from it)."""

from __future__ import annotations

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
