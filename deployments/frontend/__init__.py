"""The replica's side of the engine: the engine client the HTTP layer calls, per-request
state and detokenizing, launching and replacing workers, and the link to the monitor."""
