"""The dashboard: the run-directory format (store.py: the driver's writers and the server's reader), the local
web server behind `miles dashboard RUN_DIR` (server.py), and its static front end (static/, no build step)."""
