"""How a job is described and run: the job file, the ``isthmus`` command line, the launcher."""
