"""A rank serving: the leader's gRPC service over the step loop, its streams, KV transport, supervisor."""
