"""Which instances exist: ZMQ discovery, static instances, and the prober that admits them."""
