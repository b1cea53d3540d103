"""End to end on real vLLM (CPU build) servers."""
