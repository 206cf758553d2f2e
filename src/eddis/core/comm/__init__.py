"""The bottom of core: the process's runtime state and everything that moves data between ranks.

``runtime`` (ranks, topology, communicators), ``waits`` (every MPI call polled with a time
limit), ``ops`` (the reduction ops), ``adasum`` (Adasum's math and its recursive doubling),
``collectives`` (timed MPI collectives), ``connection`` (the job's SMB client), ``groups``
(the groups' communicators), ``elastic`` (the live ranks of an elastic run), ``observe``
(the runtime's wiring into the timeline and the profile), ``negotiate`` and ``engine`` (the
collectives a script calls, announced first). Nothing here imports the rest of core.
"""
