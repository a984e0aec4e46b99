"""Templates for real clusters (``isthmus deploy render``: Slurm, Kubernetes, a
broker) and the job's certificates (``isthmus certs``)."""
