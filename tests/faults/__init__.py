"""The fault and abuse suite: exactly-once under crashes, outages and hostile upstreams.

    cluster.py   several gateway processes on a private PostgreSQL (or a primary with a
                 streaming standby) and a private Redis
    upstream.py  the recording upstream, with faults the injector switches on and off
    faults.py    the fault injectors (kill -9, SIGSTOP past the lease, database and Redis
                 restarts, a database failover, upstream hangs, resets after commit and
                 5xx answers)
    clients.py   clients that retry like real SDKs, through a load balancer, recording
                 every answer they see
    checker.py   the invariants over the upstream's ledger, the records and the answers,
                 and the summary table
    scenario.py  one run: load, faults, healing, settling, checking
    soak.py      the long run (``python -m tests.faults.soak --minutes N``)

``test_fault_run.py`` (marker ``faults``) is the short run in the default suite, and so is
``test_failover.py`` (a primary killed and its standby promoted, synchronous and asynchronous);
``test_soak.py`` (marker ``soak``, deselected by default) is the long one; ``test_checker.py``
proves the checker reports every kind of breach it exists to catch.
"""
