"""The frontend side of the engine: the client of the engine-core process, output processing, the offline Engine."""
