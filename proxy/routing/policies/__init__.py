"""Instance selection policies: the interface (base), one module per policy, the factory."""
