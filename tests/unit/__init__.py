"""The fast tier: no vLLM server, no external binary (GPU tests skip without CUDA)."""
