"""Events: the transition vocabulary, its codec, the durable log, replay and publishers."""
