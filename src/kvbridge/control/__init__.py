"""I/O shells of the control plane: the ZMQ control channel and the bootstrap service."""
