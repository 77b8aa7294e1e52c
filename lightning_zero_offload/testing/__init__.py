"""Tools for testing training code at several ranks on one machine (the project's tests and benchmarks use
them): ``ranks.run_ranks(fn, world, tmp)`` runs ``fn(rank)`` in ``world`` processes sharing a gloo group."""
