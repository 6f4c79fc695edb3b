"""The engine packaged as a rollout worker: HTTP server, CLI and (later) the rollout worker API."""
