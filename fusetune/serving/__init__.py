"""Chat completions on a worker: the engine (engine.py) and the HTTP server the worker runs it behind (server.py)."""
