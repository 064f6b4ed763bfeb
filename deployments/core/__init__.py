"""The engine core: the round loop next to the target, its scheduler, the round statistics,
and the links to the draft (an actor, or colocated in the core's process)."""
