"""Communicators: thread ranks with mpi4py's buffer methods, or MPI's COMM_WORLD, and launching."""
