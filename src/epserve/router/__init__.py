"""The HTTP router process: the OpenAI API, routing over engine instances, streaming. Imports no torch."""
