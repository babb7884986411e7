"""The surfaces miles' components are called through, declared below every component that implements or calls
them: ``engine`` (what a rollout engine serves: the request types, ``Engine`` and the capabilities a weight sync
looks for)."""
