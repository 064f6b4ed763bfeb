"""SpecServe on Ray Serve: config, placement, worker actors, the engine and the HTTP app."""
