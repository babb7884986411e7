"""The surfaces miles' components are called through, declared below every component that implements or calls
them: ``engine`` (what a rollout engine serves: the request types, ``Engine`` and the capabilities a weight sync
looks for), ``trainer`` (``TrainerGroup``, all train ranks at once; ``TrainerBackend``, one rank) and ``reward``
(the reward contract: ``RewardFn``, ``Reward``, the ``Deferred`` part of a verifier, the calls and results of the
reward workers)."""
