"""Online serving: gRPC engine service, router (policies, OpenAI API, metrics), launcher."""
