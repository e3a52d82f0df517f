"""The processes of a deployment (above the router and the engine server) and their command-line options."""
