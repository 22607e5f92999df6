"""The launcher: `herd launch` from the command to the job's end, on the launching machine.

Read it in the order the data flows:

    launch.py    the library call: prepare, then run the job (or print its plan; --detach)
    prepare.py   connect every node, probe it, check it, plan the job   -> Prepared
    job.py       a job is a sequence of attempts: run one, ask the restart decision
                 (recovery.policy.RestartPolicy) for the next, until the job is over
    attempt/     one attempt: the plan run through the nodes' agent links, watched   -> state
                 run.py wires it; state.py what it knows; events.py the agents' events ->
                 state; watch.py silent nodes, stalls, hangs; actions.py every command to
                 the agents; request.py what an agent is asked to run
    outcome.py   what an ended attempt's state adds up to (exit code, first failure)
    teardown.py  how an attempt's nodes are stopped; sweeps.py ends what one left behind
    pool.py      spares, and lost nodes on their way back
    links.py     one agent session per node (ssh, srun or local), JSON lines both ways
    slow_ranks.py  the attempt's slow-rank watch (the judge is recovery.straggler)
    detach.py, dry_run.py  `--detach` and `--dry-run`
    groups.py    `--replica-groups`: torchft's lighthouse and one job (JobRun) per group

Borders: the launcher never imports torch; it sits above the checks (preflight/), the judges
(recovery/), the plan, the transports and the records, and shares nothing with the job-control
commands in ops/ except through modules below both (records, job_nodes, transport.agent_call).
"""
