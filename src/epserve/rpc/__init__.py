"""What both ends of the engine's gRPC service share: the protocol and the conversions to and from it."""
