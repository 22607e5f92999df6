"""Slurm and PBS: finding the allocation herd runs in, job ids, job scripts and submission.

    hostlist.py     Slurm hostlists and PBS nodefiles -> host names
    jobid.py        job ids of both schedulers
    detect.py       allocation detection (fixed order) -> ClusterSpec
    environment.py  what the batch script set up, carried to every node
    render.py       job scripts for `herd submit`
    submit.py       sbatch/qsub, the submitted-job records `herd ps` lists, their states
    requeue.py      after a saved exit: requeue (Slurm) or a chained job (PBS); PBS deadlines

How agents are started inside an allocation is a transport: transport/slurm.py (srun) and
transport/pbs.py (ssh between the allocated nodes, attached to the job).
"""
